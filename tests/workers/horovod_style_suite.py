"""A test file written the way Horovod's own test suites are (unittest, each test calling hvd.init() first),
mixing tests that fail with tests that pass, run WHOLE as one job, as Horovod's CI runs its suites.

The failure kinds come early: an error on one rank before it submits an unnamed collective while the others
submit it (the others get the stall verdict), arguments that negotiation refuses on every rank, a user's
assertion, an engine that ends because one rank shut down. Every later test must still pass. Each test
declares the outcome it should have on each rank (``@expect``); the runner writes one JSON report per rank
(``--report DIR``): every test's expectation, outcome, exception type and message. tests/test_horovod_style_suite.py
compares them; nothing here decides whether the suite passed.

Settings come from the environment as a Horovod user sets them (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS...).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback
import unittest
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

import hvdlite.torch as hvd

EPISODE_S = float(os.environ.get("SUITE_EPISODE_SECONDS", "4.0"))  # past the stall verdict, on every rank


def expect(last: str = "pass", others: Optional[str] = None, rank0: Optional[str] = None) -> Callable:
    """The outcome a test should have: "pass", or "ExceptionName" (the test fails with that exception),
    on the last rank, on rank 0 (when given) and on the other ranks (default: as on the last rank)."""
    def mark(fn: Callable) -> Callable:
        fn.expected = {"last": last, "others": last if others is None else others, "rank0": rank0}
        return fn
    return mark


def expected_for(fn: Callable, rank: int, size: int) -> str:
    e = getattr(fn, "expected", {"last": "pass", "others": "pass", "rank0": None})
    if rank == 0 and e["rank0"] is not None:
        return e["rank0"]
    return e["last"] if rank == size - 1 else e["others"]


class Episode:
    """A failing test's pacing: it starts together on every rank, and every rank leaves it only after the
    stall verdict has been reached (so a rank that failed early does not run ahead into the next test)."""

    def __enter__(self) -> "Episode":
        hvd.barrier()
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(max(0.0, self.start + EPISODE_S - time.monotonic()))


@contextlib.contextmanager
def but_rank_zero() -> Iterator[tuple[Any, list[int]]]:
    """A process set of every rank but 0, removed afterwards."""
    members = list(range(1, hvd.size()))
    ps = hvd.add_process_set(members)
    try:
        yield ps, members
    finally:
        hvd.remove_process_set(ps)


class HorovodStyleTests(unittest.TestCase):
    """Tests are named test_NN_... so that unittest's alphabetical order is the order of this file."""

    def rank_size(self) -> tuple[int, int]:
        return hvd.rank(), hvd.size()

    # -- failure kinds first ------------------------------------------------------------------------
    def test_01_allreduce_sum(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum)
        self.assertTrue(torch.equal(out, torch.full((3,), float(n * (n - 1) // 2))))

    @expect(last="KeyError", others="StallError")
    def test_02_user_error_between_two_collectives_on_the_last_rank(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        with Episode():
            hvd.allreduce(torch.ones(2))
            if r == n - 1:
                raise KeyError("the user's code failed between two collectives")
            hvd.allreduce(torch.ones(2))

    def test_03_allgather_after_a_stall(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.allgather(torch.full((r + 1, 2), float(r)))
        want = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
        self.assertTrue(torch.equal(out, want))

    @expect(last="InvalidArgumentError")
    def test_04_root_outside_the_job_on_the_last_rank(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        hvd.broadcast(torch.ones(2), n if r == n - 1 else 0)  # checked in negotiation: every rank raises

    def test_05_broadcast_every_root(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        for root in range(n):
            self.assertTrue(torch.equal(hvd.broadcast(torch.full((2,), float(r)), root), torch.full((2,), float(root))))

    @expect(last="TypeError", others="StallError")
    def test_06_wrong_argument_type_on_the_last_rank(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        with Episode():
            hvd.allreduce("not a tensor" if r == n - 1 else torch.ones(2))  # type: ignore[arg-type]

    def test_07_allreduce_average(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.allreduce(torch.full((4,), float(2 * r)))
        self.assertTrue(torch.equal(out, torch.full((4,), float(n - 1))))

    @expect(last="TypeError", others="StallError")
    def test_08_root_of_the_wrong_type_on_the_last_rank(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        with Episode():
            hvd.broadcast(torch.ones(2), "0" if r == n - 1 else 0)  # type: ignore[arg-type]

    def test_09_broadcast_after_a_bad_root(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        self.assertTrue(torch.equal(hvd.broadcast(torch.full((1,), float(r)), n - 1), torch.full((1,), float(n - 1))))

    @expect(last="TensorMismatchError")
    def test_10_dtype_differs_on_the_last_rank(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        hvd.allreduce(torch.ones(2, dtype=torch.int32 if r == n - 1 else torch.float32))

    @expect(last="AssertionError")
    def test_11_a_wrong_expectation_fails_on_every_rank(self) -> None:
        hvd.init()
        _, n = self.rank_size()
        out = hvd.allreduce(torch.ones(1), op=hvd.Sum)
        self.assertEqual(out.item(), n + 1)

    @expect(last="pass", rank0="AssertionError")
    def test_12_fails_on_rank_zero_only_after_its_collectives(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.allgather(torch.tensor([r]))
        self.assertTrue(torch.equal(out, torch.arange(n)))
        self.assertNotEqual(r, 0)

    @expect(last="pass", others="ShutdownError")
    def test_13_one_rank_shuts_down_while_the_others_wait(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        if r == n - 1:
            hvd.shutdown()  # the engine ends on every rank; every rank's next init() starts afresh
            return
        hvd.allreduce(torch.ones(1))

    @expect(last="ValueError")
    def test_14_duplicate_process_set(self) -> None:
        hvd.init()
        hvd.add_process_set(list(range(hvd.size())))  # the global set's ranks: refused on every rank

    # -- passing tests: each must pass after all of the above -------------------------------------
    def test_15_allreduce_ops(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        x = torch.tensor([float(r + 1), -float(r)])
        self.assertTrue(torch.equal(hvd.allreduce(x, op=hvd.Min), torch.tensor([1.0, -float(n - 1)])))
        self.assertTrue(torch.equal(hvd.allreduce(x, op=hvd.Max), torch.tensor([float(n), 0.0])))
        self.assertEqual(hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Product).item(),
                         float(np.prod(range(1, n + 1))))

    def test_16_allreduce_inplace_and_async(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        x = torch.full((5,), float(r))
        hvd.allreduce_(x, op=hvd.Sum)
        self.assertTrue(torch.equal(x, torch.full((5,), float(n * (n - 1) // 2))))
        handles = [hvd.allreduce_async(torch.full((2,), float(r + i)), op=hvd.Sum) for i in range(10)]
        for i, h in enumerate(handles):
            self.assertTrue(torch.equal(hvd.synchronize(h), torch.full((2,), float(n * i + n * (n - 1) // 2))))

    def test_17_grouped_allreduce(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        outs = hvd.grouped_allreduce([torch.full((2,), float(r)), torch.full((3,), 1.0)], op=hvd.Sum)
        self.assertTrue(torch.equal(outs[0], torch.full((2,), float(n * (n - 1) // 2))))
        self.assertTrue(torch.equal(outs[1], torch.full((3,), float(n))))

    def test_18_allgather_dtypes(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        for dtype in (torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
            out = hvd.allgather(torch.full((2, 2), r, dtype=dtype))
            self.assertTrue(torch.equal(out, torch.cat([torch.full((2, 2), k, dtype=dtype) for k in range(n)])))

    def test_19_grouped_allgather(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        a, b = hvd.grouped_allgather([torch.tensor([r]), torch.tensor([[r, r]])])
        self.assertTrue(torch.equal(a, torch.arange(n)))
        self.assertTrue(torch.equal(b, torch.arange(n).repeat_interleave(2).reshape(n, 2)))

    def test_20_broadcast_inplace(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        x = torch.full((3,), float(r))
        hvd.broadcast_(x, n - 1)
        self.assertTrue(torch.equal(x, torch.full((3,), float(n - 1))))

    def test_21_alltoall(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.alltoall(torch.arange(n, dtype=torch.float32) + 10 * r)
        self.assertTrue(torch.equal(out, torch.tensor([10.0 * k + r for k in range(n)])))

    def test_22_reducescatter(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        out = hvd.reducescatter(torch.ones(2 * n, 2), op=hvd.Sum)
        self.assertTrue(torch.equal(out, torch.full((2, 2), float(n))))

    def test_23_prescale_and_postscale(self) -> None:
        hvd.init()
        _, n = self.rank_size()
        out = hvd.allreduce(torch.ones(3, dtype=torch.float64), op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
        self.assertTrue(torch.equal(out, torch.full((3,), 2.0 * n, dtype=torch.float64)))

    def test_24_broadcast_object_and_allgather_object(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        self.assertEqual(hvd.broadcast_object({"r": r}, root_rank=n - 1), {"r": n - 1})
        self.assertEqual(hvd.allgather_object(r * 2), [2 * k for k in range(n)])

    def test_25_process_set_with_global_root(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        with but_rank_zero() as (ps, members):
            if r in members:
                out = hvd.broadcast(torch.full((2,), float(r)), members[-1], process_set=ps)
                self.assertTrue(torch.equal(out, torch.full((2,), float(members[-1]))))
                s = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps)
                self.assertEqual(s.item(), float(len(members)))

    @expect(last="InvalidArgumentError", rank0="pass")
    def test_26_process_set_root_outside_the_set(self) -> None:
        hvd.init()
        r, _ = self.rank_size()
        with but_rank_zero() as (ps, members):
            if r in members:
                hvd.broadcast(torch.ones(1), 0, process_set=ps)  # rank 0 is not a member

    def test_27_barrier_and_poll(self) -> None:
        hvd.init()
        r, _ = self.rank_size()
        hvd.barrier()
        h = hvd.allreduce_async(torch.ones(1) * r, op=hvd.Sum)
        while not hvd.poll(h):
            time.sleep(0.001)
        hvd.synchronize(h)

    def test_28_named_collectives(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        for i in range(5):
            out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name=f"suite.named.{i}")
            self.assertEqual(out.item(), float(n * (n - 1) // 2))

    def test_29_join_with_allgather_and_broadcast(self) -> None:
        """After a join, allreduce runs; allgather and broadcast raise on the others, as in Horovod's
        test_horovod_join_allgather/_broadcast, and the ranks stay in step for the next test."""
        hvd.init()
        r, n = self.rank_size()
        if r == n - 1:
            self.assertIn(hvd.join(), range(n))
            return
        out = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="suite.join.sum")
        self.assertEqual(out.item(), float(n - 1))
        with self.assertRaises(RuntimeError):
            hvd.allgather(torch.tensor([r]), name="suite.join.gather")
        with self.assertRaises(RuntimeError):
            hvd.broadcast(torch.tensor([float(r)]), 0, name="suite.join.bcast")
        with self.assertRaises(RuntimeError):
            hvd.allgather(torch.tensor([r]))  # an unnamed one too: names stay in step afterwards
        self.assertIn(hvd.join(), range(n))

    def test_30_distributed_optimizer_step(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        before = model.weight.detach().clone()
        model(torch.full((1, 3), float(r + 1))).sum().backward()
        opt.step()
        want = before - 0.1 * torch.full((1, 3), (n + 1) / 2)
        self.assertTrue(torch.allclose(model.weight.detach(), want, rtol=0, atol=1e-6))

    def test_31_many_unnamed_collectives_stay_in_step(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        for i in range(30):
            self.assertEqual(hvd.allreduce(torch.tensor([float(r + i)]), op=hvd.Sum).item(),
                             float(n * i + n * (n - 1) // 2))
            self.assertTrue(torch.equal(hvd.allgather(torch.tensor([r + i])), torch.arange(n) + i))
            self.assertEqual(hvd.broadcast(torch.tensor([float(r)]), i % n).item(), float(i % n))

    def test_32_shutdown_and_init_again(self) -> None:
        hvd.init()
        r, n = self.rank_size()
        hvd.shutdown()
        hvd.init()
        self.assertEqual(hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), float(n))


class _Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, Any]] = {}

    def addSuccess(self, test: Any) -> None:
        self.outcomes[test._testMethodName] = {"outcome": "pass"}

    def _failed(self, test: Any, err: Any) -> None:
        exc_type, exc, tb = err
        self.outcomes[test._testMethodName] = {
            "outcome": exc_type.__name__, "message": str(exc)[:2000],
            "traceback": "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]}

    def addFailure(self, test: Any, err: Any) -> None:
        self._failed(test, err)

    def addError(self, test: Any, err: Any) -> None:
        self._failed(test, err)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    suite = unittest.TestLoader().loadTestsFromTestCase(HorovodStyleTests)
    result = _Recorder()
    started = time.monotonic()
    for test in suite:
        t0 = time.monotonic()
        test.run(result)
        name = test._testMethodName
        result.outcomes.setdefault(name, {"outcome": "not run"})
        result.outcomes[name]["expected"] = expected_for(getattr(HorovodStyleTests, name), rank, size)
        result.outcomes[name]["seconds"] = round(time.monotonic() - t0, 3)
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "size": size, "order": [t._testMethodName for t in suite], "tests": result.outcomes,
         "seconds": round(time.monotonic() - started, 3)}, indent=1))
    hvd.shutdown()


if __name__ == "__main__":
    main()
