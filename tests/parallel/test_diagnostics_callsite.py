"""Stall and mismatch errors name, for each rank, the line of the user's code that submitted the op (the first
frame outside hvdlite and the frameworks), on every rank."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import hvdlite as hvd
import hvdlite.torch as hvd_torch

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 240

HERE = os.path.relpath(__file__)


def _line(marker: str) -> str:
    """``file:line`` of the line of this file that ends with ``marker``."""
    with open(__file__) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(marker) and "_line(" not in text:
                return f"{HERE}:{number}"
    raise AssertionError(marker)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def test_mismatch_names_each_ranks_line(rank: int, size: int) -> None:
    last = size - 1
    with pytest.raises(hvd.TensorMismatchError) as info:
        if rank == last:
            hvd.allreduce(np.ones(4), name="cs.mismatch")  # site-last
        else:
            hvd.allreduce(np.ones(3), name="cs.mismatch")  # site-others
    expected = f"Submitted at: {_ranks(list(range(last)))}: {_line('# site-others')}; rank {last}: " \
               f"{_line('# site-last')}."
    assert expected in str(info.value), str(info.value)
    assert len(set(hvd.allgather_object(str(info.value).split(": ", 1)[1]))) == 1


def test_stall_names_each_ranks_line_and_what_the_others_waited_on(reinit, rank: int, size: int) -> None:
    reinit(stall_check_time_seconds=0.5, stall_shutdown_time_seconds=1.0)
    with pytest.raises(hvd.StallError) as info:
        if rank == 0:
            hvd.allreduce(np.ones(2), name="cs.stall")  # site-stalled
        else:
            hvd.allreduce(np.ones(2), name="cs.other")  # site-other
    text = str(info.value)
    others = list(range(1, size))
    if rank == 0:
        assert "'cs.stall' stalled" in text and f"Submitted at: rank 0: {_line('# site-stalled')}." in text, text
        for r in others:
            assert f"Rank {r} was waiting on 'cs.other' at {_line('# site-other')} instead." in text, text
    else:
        assert "'cs.other' stalled" in text, text
        assert f"Submitted at: {_ranks(others)}: {_line('# site-other')}." in text, text
        assert f"Rank 0 was waiting on 'cs.stall' at {_line('# site-stalled')} instead." in text, text


def test_a_cached_name_that_stalls_names_the_line_of_its_first_submission(reinit, rank: int, size: int) -> None:
    reinit(stall_check_time_seconds=0.5, stall_shutdown_time_seconds=1.0)
    for step in range(3):
        if step < 2 or rank == 0:
            with pytest.raises(hvd.StallError) if step == 2 else _nothing() as info:
                hvd.allreduce(np.ones(2), name="cs.cached")  # site-cached
    if rank == 0:
        assert f"Submitted at: rank 0: {_line('# site-cached')}." in str(info.value), str(info.value)
    else:
        time.sleep(2.0)  # not submitting: rank 0's cached name stalls


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_torch_optimizer_names_the_users_line_not_torchs_or_hvdlites(reinit, overlap: str, rank: int,
                                                                     size: int) -> None:
    # The gradients are submitted from hvdlite's autograd hooks under torch's backward (overlap on), or from
    # hvdlite's step(): the line named is the user's backward() or step() call, never torch's or hvdlite's.
    reinit(gradient_overlap=overlap)
    last = size - 1
    model = torch.nn.Linear(4 if rank == last else 3, 1, bias=False)
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    with pytest.raises(hvd.TensorMismatchError) as info:
        model(torch.ones(1, model.in_features)).sum().backward()  # site-backward
        opt.step()  # site-step
    # with overlap a gradient bucket may be submitted from backward or, its last bucket, from step()
    sites = [_line("# site-step")] + ([_line("# site-backward")] if overlap == "on" else [])
    assert any(f"Submitted at: {_ranks(list(range(size)))}: {site}." in str(info.value) for site in sites), \
        str(info.value)


class _nothing:
    value: BaseException

    def __enter__(self) -> "_nothing":
        return self

    def __exit__(self, *exc: object) -> None:
        return None
