"""Bytes per step that powerSGD_hook hands to allreduce, against uncompressed averaging, for ResNet-50's gradients.

    python benchmarks/lab/powersgd_bytes.py --out benchmarks/results/powersgd_bytes.json        # ~1 min
    mpiexec -n 2 python benchmarks/lab/powersgd_bytes.py                                         # same bytes

ResNet-50's 161 gradient tensors (benchmarks/shapes.py, float32) are packed, in backward order, into buckets of
about ``--bucket-mb`` (DDP's default 25 MB), each a flat buffer with per-parameter views (the comm-hook
protocol). Random gradients go through powerSGD_hook (start_powerSGD_iter=0) for ``--steps`` steps at each
``--ranks`` matrix_approximation_rank. Each step's bytes are those of the tensors the hook submits (P, Q and the
uncompressed ones; what each rank sends on the wire is a fixed multiple of this for a given allreduce
algorithm, the same for both). One JSON line per rank, then the uncompressed line; ``ms_per_step`` is the hook's
time including its own compute (orthogonalization, matmuls), informative only.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import Output, machine_info  # noqa: E402


class ShapeBucket:
    """A bucket of gradients of the given shapes: one flat float32 buffer, the gradients are views into it."""

    def __init__(self, index: int, shapes: list[tuple[int, ...]], last: bool, process_set: object) -> None:
        import torch
        self._index, self._last, self.process_set = index, last, process_set
        self.name = f"bench.bucket{index}"
        self._buffer = torch.empty(sum(_numel(s) for s in shapes))
        self._views, at = [], 0
        for shape in shapes:
            self._views.append(self._buffer[at:at + _numel(shape)].view(shape))
            at += _numel(shape)

    def index(self) -> int:
        return self._index

    def buffer(self):  # noqa: ANN201
        return self._buffer

    def gradients(self) -> list:
        return self._views

    def parameters(self) -> list:
        return self._views

    def is_last(self) -> bool:
        return self._last


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def buckets(shapes: list[tuple[int, ...]], bucket_mb: float, process_set: object) -> list[ShapeBucket]:
    limit = bucket_mb * 2 ** 20 / 4
    groups: list[list[tuple[int, ...]]] = [[]]
    for shape in reversed(shapes):  # backward produces the last layers' gradients first
        if groups[-1] and sum(_numel(s) for s in groups[-1]) + _numel(shape) > limit:
            groups.append([])
        groups[-1].append(shape)
    return [ShapeBucket(i, g, i == len(groups) - 1, process_set) for i, g in enumerate(groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--ranks", default="1,2,4", help="matrix_approximation_rank values")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every tensor (smoke runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    import hvdlite.torch as hvd
    from hvdlite.torch.powersgd import PowerSGDState, powerSGD_hook
    from shapes import gradient_shapes, scaled_shapes

    hvd.init()
    out = Output(hvd.rank(), args.out)
    out.emit(machine_info("powersgd_bytes", hvd.size(), model=args.model))
    shapes = scaled_shapes(gradient_shapes(args.model), args.scale)
    uncompressed = sum(_numel(s) for s in shapes) * 4
    generator = torch.Generator().manual_seed(hvd.rank())
    for rank in (int(r) for r in args.ranks.split(",")):
        state = PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=0)
        bucket_list = buckets(shapes, args.bucket_mb, hvd.global_process_set)
        per_step, times = [], []
        for _ in range(args.steps):
            for b in bucket_list:
                b.buffer().copy_(torch.randn(b.buffer().shape, generator=generator))
            sent, began = state.bytes_allreduced, time.perf_counter()
            for future in [powerSGD_hook(state, b) for b in bucket_list]:
                future.wait()
            times.append((time.perf_counter() - began) * 1e3)
            per_step.append(state.bytes_allreduced - sent)
        compressed = sum(1 for s in shapes if len(s) >= 2 and
                         (s[0] + _numel(s) // s[0]) * min(s[0], _numel(s) // s[0], rank) * 2 < _numel(s))
        out.emit({"kind": "result", "method": f"powersgd_rank{rank}", "model": args.model, "ranks": hvd.size(),
                  "matrix_approximation_rank": rank, "buckets": len(bucket_list), "tensors": len(shapes),
                  "tensors_compressed": compressed, "bytes_per_step": per_step[-1],
                  "uncompressed_bytes_per_step": uncompressed, "ratio": per_step[-1] / uncompressed,
                  "reduction": uncompressed / per_step[-1], "ms_per_step": min(times)})
    out.emit({"kind": "result", "method": "uncompressed", "model": args.model, "ranks": hvd.size(),
              "bytes_per_step": uncompressed, "uncompressed_bytes_per_step": uncompressed, "ratio": 1.0})
    out.emit({"kind": "done"})
    out.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
