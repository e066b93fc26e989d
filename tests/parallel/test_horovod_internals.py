"""Names Horovod's own tests reach for: ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()`` (torch and
TensorFlow), ``hvd.gpu_available(framework)``, and a process set whose id was changed by hand refused with
ValueError when the op is built (TensorFlow eagerly and in a graph, torch)."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import hvdlite.tensorflow as htf  # noqa: E402
import hvdlite.torch as hto  # noqa: E402

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 240
r, n = hto.rank(), hto.size()


def test_get_process_set_ids_and_ranks_in_both_frontends() -> None:
    for hvd in (hto, htf):
        assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(n))}
        assert hvd.mpi_ops._basics.size() == n  # the runtime's functions, as on Horovod's HorovodBasics
    odd = hto.add_process_set(list(range(1, n, 2)))
    evens = hto.add_process_set(list(range(0, n, 2)))
    try:
        table = {0: list(range(n)), odd.process_set_id: list(range(1, n, 2)),
                 evens.process_set_id: list(range(0, n, 2))}
        assert len(table) == 3
        for hvd in (hto, htf):
            assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == table
    finally:
        hto.remove_process_set(evens)
        hto.remove_process_set(odd)
    assert htf.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(n))}


def test_gpu_available_answers_for_each_framework() -> None:
    for hvd in (hto, htf):
        assert hvd.gpu_available("torch") is torch.cuda.is_available() is False  # CUDA hidden in this job
        assert hvd.gpu_available("tensorflow") is bool(tf.config.list_physical_devices("GPU")) is False
        assert hvd.gpu_available("mxnet") is False  # no such frontend here


def _fake_set() -> hto.ProcessSet:
    fake = hto.ProcessSet(list(range(n)))
    fake.process_set_id = 7  # never registered: Horovod's tests change the id by hand
    return fake


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("op", ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier"])
def test_tensorflow_refuses_an_unknown_process_set_when_the_op_is_built(mode: str, op: str) -> None:
    fake = _fake_set()
    x = tf.ones([n, 2])
    build = {"allreduce": lambda: htf.allreduce(x, process_set=fake),
             "allgather": lambda: htf.allgather(x, process_set=fake),
             "broadcast": lambda: htf.broadcast(x, 0, process_set=fake),
             "alltoall": lambda: htf.alltoall(x, process_set=fake),
             "reducescatter": lambda: htf.reducescatter(x, process_set=fake),
             "barrier": lambda: htf.barrier(process_set=fake)}[op]
    with pytest.raises(ValueError, match="is not registered on rank"):
        if mode == "eager":
            build()
        else:
            tf.function(build).get_concrete_function()  # traced (built), never run
    # every rank still agrees on the next unnamed collective
    assert np.array_equal(htf.allreduce(tf.fill([2], float(r)), op=htf.Sum).numpy(), [n * (n - 1) / 2] * 2)


def test_torch_refuses_an_unknown_process_set() -> None:
    fake = _fake_set()
    with pytest.raises(ValueError, match="not registered"):
        hto.allreduce(torch.ones(2), process_set=fake)
    assert torch.equal(hto.allreduce(torch.full([2], float(r)), op=hto.Sum), torch.full([2], n * (n - 1) / 2))
