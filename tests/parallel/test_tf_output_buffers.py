"""Reduction outputs written into given or reused buffers: core ``grouped_allreduce(outputs=...)`` is exact and
returns the given arrays; a tf.function allreduce reuses its output buffers from step to step only when nothing
holds the previous step's results (kept results stay intact), and the results stay exact throughout."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite as core  # noqa: E402
import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.tensorflow import buffers  # noqa: E402
from exact import same  # noqa: E402

MPI_SIZES = (2, 3)
r, n = hvd.rank(), hvd.size()
# one tensor reduced on its own (64 KiB: a base array) and two small ones fused together
SHAPES = [(128, 128), (5,), (3, 2)]


def inputs(step: int) -> list:
    return [np.full(s, float(10 * step + r + i), np.float32) for i, s in enumerate(SHAPES)]


def expected(step: int) -> list:
    return [np.full(s, float(sum(10 * step + k + i for k in range(n))), np.float32) for i, s in enumerate(SHAPES)]


def test_core_grouped_allreduce_into_given_outputs() -> None:
    outs = [np.zeros(s, np.float32) for s in SHAPES]
    results = core.grouped_allreduce(inputs(1), op=core.Sum, name="into", outputs=outs)
    assert all(res is out for res, out in zip(results, outs))
    for i, (out, want) in enumerate(zip(outs, expected(1))):
        same(out, want, f"output {i}")
    with pytest.raises(TypeError, match=r"allreduce 'badshape': outputs must be one array per input with the "
                                        r"input's shape; got \[\(2, 2\)\] for inputs \[\(4,\)\]"):
        core.grouped_allreduce([np.ones(4, np.float32)], name="badshape", outputs=[np.zeros((2, 2), np.float32)])


def test_graph_allreduce_reuses_buffers_only_when_released(monkeypatch: pytest.MonkeyPatch) -> None:
    step = tf.function(lambda xs: hvd.grouped_allreduce(xs, op=hvd.Sum, name="reuse"))
    kept = step([tf.constant(a) for a in inputs(1)])
    pointers = [t._numpy().ctypes.data for t in kept]
    second = step([tf.constant(a) for a in inputs(2)])
    for i, (t, want) in enumerate(zip(kept, expected(1))):
        same(t.numpy(), want, f"kept result {i} after the next step")  # not overwritten
    for i, (t, want) in enumerate(zip(second, expected(2))):
        same(t.numpy(), want, f"second step {i}")
    assert second[0]._numpy().ctypes.data != pointers[0], "a held result's buffer was reused"
    del kept, second
    third = step([tf.constant(a) for a in inputs(3)])
    pointer = third[0]._numpy().ctypes.data
    view = third[0]._numpy()[3:]  # a numpy view the caller keeps also holds the buffer
    for i, (t, want) in enumerate(zip(third, expected(3))):
        same(t.numpy(), want, f"third step {i}")
    del third
    fourth = step([tf.constant(a) for a in inputs(4)])
    same(view, expected(3)[0][3:], "a kept view after the next step")
    assert fourth[0]._numpy().ctypes.data != pointer
    for i, (t, want) in enumerate(zip(fourth, expected(4))):
        same(t.numpy(), want, f"fourth step {i}")
    del fourth, view, t
    fresh = []  # the arrays the op allocates from here on (reusing one allocates none)
    allocate = buffers.aligned_empty
    monkeypatch.setattr(buffers, "aligned_empty", lambda *a: fresh.append(a) or allocate(*a))
    for k in range(5, 45):  # nothing held: TensorFlow releases a result's array at once in most steps (from
        result = step([tf.constant(a) for a in inputs(k)])  # its own threads it may do so a moment late)
        for i, (t, want) in enumerate(zip(result, expected(k))):
            same(t.numpy(), want, f"step {k}, result {i}")
        del result, t
    assert len(fresh) <= 3 * 20, f"released buffers were reused in under half of 40 steps: {len(fresh)} allocations"
