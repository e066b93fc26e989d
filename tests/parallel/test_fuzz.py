"""Fuzz: seeded random collective programs (tests/fuzz_programs.py), every result checked exactly.

Each test runs a block of seeds under one engine configuration. A failure names the seed; replay it alone
with ``HVDT_FUZZ_SEED=<seed> python -m pytest -q tests/test_parallel.py -k test_fuzz``.
``HVDT_FUZZ_PROGRAMS=<n>`` changes how many programs each block runs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hvdlite as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fuzz_programs import Generator, Op, Step, as_float, expected, inputs, storage  # noqa: E402

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 400

#: Engine settings each block of seeds runs under (fusion off, tiny chunks, evicting or no cache...).
SETTINGS = [
    {},
    {"fusion_threshold_bytes": 0},
    {"cache_capacity": 3, "allreduce_chunk_bytes": 16, "fusion_threshold_bytes": 64,
     "join_allows_allgather_broadcast": True},
    {"cache_capacity": 0, "cycle_time_ms": 0},
]
REPLAY = os.environ.get("HVDT_FUZZ_SEED")
PER_BLOCK = int(os.environ.get("HVDT_FUZZ_PROGRAMS", "20"))


def _seeds(block: int) -> list[int]:
    if REPLAY is not None:
        return [int(REPLAY)] if block == 0 else []
    return list(range(block * 1000, block * 1000 + PER_BLOCK))


def _submit(op: Op, rank: int, sets: dict) -> Any:
    arrays = [storage(x, d) for x, d in zip(inputs(op, rank), op.dtypes)]
    if op.scalar:
        arrays = [a.reshape(()) for a in arrays]
    hints = ["bfloat16" if d == "bfloat16" else None for d in op.dtypes]
    ps = hvd.global_process_set if op.pset is None else sets[op.pset]
    reduce_op = getattr(hvd, op.op)
    if op.kind == "barrier":
        return hvd.barrier(process_set=ps), arrays
    if op.kind == "allreduce":
        if op.grouped:
            return hvd.grouped_allreduce_async(arrays, name=op.name, op=reduce_op, prescale_factor=op.pre,
                                               postscale_factor=op.post, process_set=ps,
                                               dtype_hints=hints), arrays
        return hvd.allreduce_async(arrays[0], name=op.name, op=reduce_op, prescale_factor=op.pre,
                                   postscale_factor=op.post, process_set=ps, inplace=op.inplace,
                                   dtype_hint=hints[0]), arrays
    if op.kind == "reducescatter":
        if op.grouped:
            return hvd.grouped_reducescatter_async(arrays, name=op.name, op=reduce_op, process_set=ps,
                                                   prescale_factor=op.pre, postscale_factor=op.post,
                                                   dtype_hints=hints), arrays
        return hvd.reducescatter_async(arrays[0], name=op.name, op=reduce_op, process_set=ps,
                                       prescale_factor=op.pre, postscale_factor=op.post,
                                       dtype_hint=hints[0]), arrays
    if op.kind == "allgather":
        if op.grouped:
            return hvd.grouped_allgather_async(arrays, name=op.name, process_set=ps, dtype_hints=hints), arrays
        return hvd.allgather_async(arrays[0], name=op.name, process_set=ps, dtype_hint=hints[0]), arrays
    if op.kind == "broadcast":
        return hvd.broadcast_async(arrays[0], op.members[op.root], name=op.name, process_set=ps, inplace=op.inplace,
                                   dtype_hint=hints[0]), arrays
    splits = None if op.splits is None else list(op.splits[rank])
    return hvd.alltoall_async(arrays[0], splits=splits, name=op.name, process_set=ps,
                              dtype_hint=hints[0]), arrays


def _same(got: Any, want: np.ndarray, dtype: str) -> bool:
    got = np.asarray(got)
    store = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)
    if got.dtype != store or got.shape != want.shape:
        return False
    return bool(np.array_equal(as_float(got, dtype), want))


def _check(op: Op, rank: int, result: Any, arrays: list, active: Any = None) -> str:
    """'' if ``result`` is exactly right, else what differs."""
    if op.kind == "barrier":
        return "" if result is None else f"barrier returned {result!r}"
    want = expected(op, rank, active)
    got_list, want_list = (result, want) if op.grouped else ([result], [want])
    if len(got_list) != len(want_list):
        return f"{len(got_list)} results for {len(want_list)} tensors"
    for i, (got, exp) in enumerate(zip(got_list, want_list)):
        dtype = op.dtypes[i]
        if op.kind == "alltoall":
            ok = _same(got[0], exp[0], dtype) and np.array_equal(np.asarray(got[1]), exp[1])
        else:
            ok = _same(got, exp, dtype)
        if ok and op.inplace and got is not arrays[i]:
            return f"tensor {i}: an in-place op returned a new array"
        if not ok:
            return f"tensor {i} ({dtype}): got {got!r}, expected {exp!r}"
    return ""


def run_program(seed: int, rank: int, size: int, permissive_join: bool = False) -> list[str]:
    """Run program ``seed`` on this rank; return what went wrong (empty when every result was exact)."""
    steps: list[Step] = Generator(seed, size, permissive_join).program()
    sets: dict = {}
    problems: list[str] = []

    def note(where: str, op: Op, message: str) -> None:
        problems.append(f"seed {seed} rank {rank} {where}: {op.describe()}: {message}")

    for s, step in enumerate(steps):
        if step.what == "add":
            sets[step.ranks] = hvd.add_process_set(list(step.ranks))
        elif step.what == "remove":
            hvd.remove_process_set(sets.pop(step.ranks))
        elif step.what == "join":
            if rank in step.ranks:
                last = hvd.join()
                if last != step.ops[0]:
                    problems.append(f"seed {seed} rank {rank} step {s}: join() returned {last}, expected "
                                    f"{step.ops[0]} (the rank that joined last)")
        elif step.what == "sync":
            op = step.ops[0]
            if rank not in op.members or (step.ranks and rank not in step.ranks):
                continue
            try:
                handle, arrays = _submit(op, rank, sets)
                result = handle if op.kind == "barrier" else handle.wait()
                message = _check(op, rank, result, arrays, step.ranks or None)
            except Exception as exc:  # noqa: BLE001 - report and go on, so the ranks stay in step
                message = f"raised {type(exc).__name__}: {exc}"
            if message:
                note(f"step {s} (sync)", op, message)
        else:
            _run_batch(seed, s, step, rank, sets, note)
    return problems


def _run_batch(seed: int, s: int, step: Step, rank: int, sets: dict, note: Any) -> None:
    mine = [i for i, op in enumerate(step.ops) if rank in op.members]
    rng = np.random.default_rng([seed, s, rank, 31])
    order = mine if step.ordered else [mine[i] for i in rng.permutation(len(mine))]
    pending: dict[int, Any] = {}
    for i in order:
        op = step.ops[i]
        try:
            handle, arrays = _submit(op, rank, sets)
            if i == step.sync_at and op.kind != "barrier":
                message = _check(op, rank, handle.wait(), arrays)
                if message:
                    note(f"step {s} op {i} (sync in batch)", op, message)
            elif op.kind == "barrier":
                continue
            else:
                pending[i] = (handle, arrays)
        except Exception as exc:  # noqa: BLE001
            note(f"step {s} op {i} (submit)", op, f"raised {type(exc).__name__}: {exc}")
    waits = list(pending)
    for j in rng.permutation(len(waits)):
        i = waits[j]
        op = step.ops[i]
        handle, arrays = pending[i]
        try:
            message = _check(op, rank, hvd.synchronize(handle), arrays)
        except Exception as exc:  # noqa: BLE001
            message = f"raised {type(exc).__name__}: {exc}"
        if message:
            note(f"step {s} op {i} (async)", op, message)


@pytest.mark.parametrize("block", range(len(SETTINGS)))
def test_random_programs_give_exact_results(block: int, rank: int, size: int, reinit: Any) -> None:
    settings = SETTINGS[block]
    if settings:
        reinit(**settings)
    problems: list[str] = []
    seeds = _seeds(block)
    for seed in seeds:
        problems.extend(run_program(seed, rank, size, settings.get("join_allows_allgather_broadcast", False)))
    first = problems[0].split(" rank ")[0] if problems else ""
    assert not problems, (f"{len(problems)} wrong results at -n {size} with settings {settings}; replay "
                          f"with HVDT_FUZZ_SEED={first.split()[-1]}:\n" + "\n".join(problems[:15]))
    assert hvd.allreduce(np.array([len(seeds)]), op=hvd.Sum, name=f"fuzz.done.{block}") == len(seeds) * size
