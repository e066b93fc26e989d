"""Every hvdlite.tensorflow name: collectives eagerly and in tf.function, their gradients (Horovod's
conventions, exact), sparse tensors, DistributedGradientTape equivalence with single-process training,
helpers, process sets, SyncBatchNormalization, the XLA errors, the timeline."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
from exact import same  # noqa: E402

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 420
tf.get_logger().setLevel("ERROR")
r, n = hvd.rank(), hvd.size()
MODES = {"eager": lambda f: f, "graph": tf.function}


def close(actual, expected, what: str, rtol: float = 1e-6, atol: float = 1e-6) -> None:  # noqa: ANN001
    a = actual.numpy() if hasattr(actual, "numpy") else np.asarray(actual)
    assert a.shape == np.shape(expected) and np.allclose(a, expected, rtol=rtol, atol=atol), \
        f"{what}: got {a!r}, expected {np.asarray(expected)!r}"


def test_topology_build_flags_and_rank_ops() -> None:
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (r, n) and 0 <= hvd.local_rank() < hvd.local_size() <= n
    assert 0 <= hvd.cross_rank() < hvd.cross_size() and hvd.local_size() * hvd.cross_size() == n
    for mode, wrap in MODES.items():
        ops = wrap(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                            hvd.process_set_included_op()])()
        same([int(t) for t in ops], [r, n, hvd.local_rank(), hvd.local_size(), 1], f"{mode} *_op")
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert (hvd.mpi_enabled(), hvd.mpi_built()) == (True, True)
    assert not any([hvd.gloo_enabled(), hvd.nccl_built(), hvd.ddl_built(), hvd.ccl_built(), hvd.cuda_built(),
                    hvd.rocm_built()])
    # gloo is built where a registered frontend can run it: hvdlite.torch, when this process loaded it (the
    # files of tests/parallel share processes)
    torch_frontend = "hvdlite.torch" in sys.modules
    assert hvd.gloo_built() == (torch_frontend and sys.modules["torch"].distributed.is_gloo_available())


base = np.arange(6, dtype=np.float32).reshape(2, 3)
every = np.stack([base + k for k in range(n)])
root = n - 1
big = np.arange((2 * n + 1) * 2, dtype=np.float32).reshape(2 * n + 1, 2)
start = 0 if r == 0 else 3 + 2 * (r - 1)  # 2n+1 rows: earlier ranks take the remainder
share = slice(start, start + (3 if r == 0 else 2))
EXPECTED = {
    "average": every.mean(0), "average=False": every.sum(0), "Sum": every.sum(0), "Min": every.min(0),
    "Max": every.max(0), "Product": every.prod(0), "Average": every.mean(0), "pre/postscale": every.sum(0),
    "fp16": every.mean(0), "float16 sum": every.sum(0), "bfloat16 sum": every.sum(0),
    "int32 sum": np.array([n * (n - 1) // 2, n], np.int32),
    "grouped_allreduce[0]": every.sum(0), "grouped_allreduce[1]": np.array([n * (n - 1) // 2], np.int64),
    "allgather": np.concatenate([np.full((k + 1, 2), float(k), np.float32) for k in range(n)]),
    "grouped_allgather[0]": np.concatenate([np.full((k + 1, 2), float(k), np.float32) for k in range(n)]),
    "grouped_allgather[1]": np.arange(n, dtype=np.int32), "broadcast": base + root,
    "alltoall": np.concatenate([np.full((r + 1, 2), 10 * k + r, np.float32) for k in range(n)]),
    "alltoall received splits": np.full(n, r + 1, np.int32),
    "alltoall even": np.arange(n, dtype=np.float32).reshape(n, 1),
    "reducescatter average": (big + (n - 1) / 2.0)[share], "grouped_reducescatter[0]": n * big[share],
    "grouped_reducescatter[1]": 2 * n * big[share],
}


def collectives(x, ints, i64, rows, i32, send, even, big_r, big):  # noqa: ANN001, ANN201
    out = {"average": hvd.allreduce(x), "average=False": hvd.allreduce(x, average=False),
           "pre/postscale": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
           "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
           "int32 sum": hvd.allreduce(ints, op=hvd.Sum)}
    for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average):
        out[op.value] = hvd.allreduce(x, op=op)
    for half in (tf.float16, tf.bfloat16):
        out[f"{half.name} sum"] = tf.cast(hvd.allreduce(tf.cast(x, half), op=hvd.Sum), tf.float32)
    out["grouped_allreduce[0]"], out["grouped_allreduce[1]"] = hvd.grouped_allreduce([x, i64], op=hvd.Sum)
    out["allgather"] = hvd.allgather(rows)
    out["grouped_allgather[0]"], out["grouped_allgather[1]"] = hvd.grouped_allgather([rows, i32])
    out["broadcast"] = hvd.broadcast(x, root)
    out["alltoall"], out["alltoall received splits"] = hvd.alltoall(send, splits=[k + 1 for k in range(n)])
    out["alltoall even"] = hvd.alltoall(even)
    out["reducescatter average"] = hvd.reducescatter(big_r)
    out["grouped_reducescatter[0]"], out["grouped_reducescatter[1]"] = hvd.grouped_reducescatter(
        [big, big * 2], op=hvd.Sum)
    hvd.barrier()
    out["join"] = hvd.join()
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_collectives(mode: str) -> None:
    """Every collective in one function (in tf.function: one trace)."""
    wrap = MODES[mode]
    inputs = dict(x=tf.constant(base + r), ints=tf.constant([r, 1], tf.int32), i64=tf.constant([r], tf.int64),
                  rows=tf.fill([r + 1, 2], float(r)), i32=tf.constant([r], tf.int32),
                  send=tf.constant(np.concatenate([np.full((k + 1, 2), 10 * r + k, np.float32) for k in range(n)])),
                  even=tf.constant(np.full((n, 1), r, np.float32)), big_r=tf.constant(big + r),
                  big=tf.constant(big))
    got = wrap(collectives)(**inputs)
    assert 0 <= int(got.pop("join")) < n
    assert got["fp16"].dtype == tf.float32, got["fp16"].dtype
    for key, value in EXPECTED.items():
        if value.dtype.kind == "f":
            close(got[key], value, f"{mode} {key}", rtol=1e-3 if key == "fp16" else 1e-6)
        else:
            same(got[key].numpy(), value, f"{mode} {key}")
    var = tf.Variable(base + r)
    wrap(lambda: hvd.broadcast_([var], root_rank=root))()
    close(var, base + root, f"{mode} broadcast_")


def test_scale_factors_round_as_horovods_own_tests_expect() -> None:
    """Horovod's test_tensorflow.py (allreduce/reducescatter cpu prescale and postscale, exact at <= 3 ranks):
    the expected value is ``cast(factor * tensor, dtype) * size`` (postscale: ``cast(factor * (tensor * size),
    dtype)``), the product taken in float64 for integers, float32 for float16, else in the dtype."""
    factor = 0.1915194503788923  # np.random.seed(1234); np.random.uniform()
    mine = slice(4 * r, 4 * r + 4)
    for dtype in (tf.int32, tf.int64, tf.float16, tf.float32):
        math = tf.float64 if dtype.is_integer else tf.float32 if dtype == tf.float16 else dtype
        x = tf.cast(tf.round(tf.reshape(tf.range(4 * n * 17, dtype=tf.float32), [4 * n, 17]) * 1.37 - 60), dtype)
        f = tf.constant(factor, math)
        pre = tf.cast(f * tf.cast(x, math), dtype) * n
        post = tf.cast(f * tf.cast(x * n, math), dtype)
        for what, got, want in [
                ("allreduce prescale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor), pre),
                ("allreduce postscale", hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor), post),
                ("reducescatter prescale", hvd.reducescatter(x, op=hvd.Sum, prescale_factor=factor), pre[mine]),
                ("reducescatter postscale", hvd.reducescatter(x, op=hvd.Sum, postscale_factor=factor),
                 post[mine])]:
            same(got.numpy(), want.numpy(), f"{what} {dtype.name}")


weight = float(r + 1)  # each rank weighs its loss by rank + 1
total = n * (n + 1) // 2
row_w = np.arange(1, total + 1, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
offset = r * (r + 1) // 2
owner = np.array([0] * 3 + [k for k in range(1, n) for _ in range(2)], np.float32)
GRAD_EXPECTED = {
    "allreduce(Sum)": np.full((2, 3), n * (n + 1) / 2), "allreduce(Average)": np.full((2, 3), (n + 1) / 2),
    "grouped_allreduce": np.full((2, 3), n * (n + 1)),
    "allgather": (n + 1) / 2 * row_w[offset:offset + r + 1],
    "grouped_allgather": (n + 1) / 2 * row_w[offset:offset + r + 1],
    "broadcast": np.full((2, 3), (n + 1) / 2 if r == 0 else 0.0),
    "alltoall": np.concatenate([np.full((k + 1, 2), k + 1.0, np.float32) for k in range(n)]),
    "reducescatter(Sum)": n * (owner + 1)[:, None] * np.ones((1, 2)),
    # the scale factors multiply the gradient, as the chain rule says (and as hvdlite.torch does)
    "reducescatter(Average, scaled)": 0.75 * (owner + 1)[:, None] * np.ones((1, 2)),
}


def gradients(x, rows, send, big):  # noqa: ANN001, ANN201
    losses = {
        "allreduce(Sum)": (x, lambda v: tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum))),
        "allreduce(Average)": (x, lambda v: tf.reduce_sum(hvd.allreduce(v))),
        "grouped_allreduce": (x, lambda v: tf.reduce_sum(hvd.grouped_allreduce([v, 2 * v], op=hvd.Sum)[1])),
        "allgather": (rows, lambda v: tf.reduce_sum(hvd.allgather(v) * row_w)),
        "grouped_allgather": (rows, lambda v: tf.reduce_sum(hvd.grouped_allgather([v])[0] * row_w)),
        "broadcast": (x, lambda v: tf.reduce_sum(hvd.broadcast(v, 0))),
        "alltoall": (send, lambda v: tf.reduce_sum(hvd.alltoall(v, splits=list(range(1, n + 1)))[0])),
        "reducescatter(Sum)": (big, lambda v: tf.reduce_sum(hvd.reducescatter(v, op=hvd.Sum))),
        "reducescatter(Average, scaled)": (big, lambda v: tf.reduce_sum(hvd.reducescatter(
            v, op=hvd.Average, prescale_factor=1.5, postscale_factor=0.5))),
    }
    out = {}
    for key, (v, fn) in losses.items():
        with tf.GradientTape() as tape:
            tape.watch(v)
            loss = fn(v) * weight
        out[key] = tape.gradient(loss, v)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_follow_horovods_conventions(mode: str) -> None:
    grad_inputs = dict(x=tf.constant(base + r), rows=tf.fill([r + 1, 2], 1.0),
                       send=tf.constant(np.ones((total, 2), np.float32)),
                       big=tf.constant(np.ones((2 * n + 1, 2), np.float32)))
    got = MODES[mode](gradients)(**grad_inputs)
    for key, value in GRAD_EXPECTED.items():
        close(got[key], value, f"{mode} d {key}")


@pytest.mark.parametrize("mode", list(MODES))
def test_indexed_slices(mode: str) -> None:
    wrap = MODES[mode]
    slices = tf.IndexedSlices(tf.fill([1, 2], r + 1.0), tf.constant([r]), dense_shape=tf.constant([n, 2]))
    for op, scale in [(hvd.Average, 1.0 / n), (hvd.Sum, 1.0)]:
        red = wrap(lambda s: hvd.allreduce(s, op=op))(slices)
        assert isinstance(red, tf.IndexedSlices), type(red)
        close(tf.convert_to_tensor(red), scale * np.arange(1, n + 1)[:, None] * np.ones((1, 2)),
              f"{mode} IndexedSlices {op}")
    with pytest.raises(NotImplementedError, match="only hvd.Average and hvd.Sum"):
        hvd.allreduce(slices, op=hvd.Max)
    table = tf.Variable(np.zeros((n + 2, 3), np.float32))
    for sparse_as_dense in (False, True):
        def sparse_grad(idx):  # noqa: ANN001, ANN202
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(table, idx)) * weight
            return hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [table])[0]
        grad = wrap(sparse_grad)(tf.constant([r, r + 2]))
        assert isinstance(grad, tf.IndexedSlices) != sparse_as_dense, (sparse_as_dense, type(grad))
        expect = np.zeros((n + 2, 3), np.float32)
        for k in range(n):
            expect[[k, k + 2]] += (k + 1.0) / n
        close(tf.convert_to_tensor(grad), expect, f"{mode} sparse grad sparse_as_dense={sparse_as_dense}")


def test_distributed_gradient_tape_equals_single_process_training() -> None:
    """k ranks x batch b == one process on the concatenated batch; op=Sum differs, identically everywhere."""
    rng = np.random.default_rng(7)
    b, steps = 4, 3
    X = rng.normal(size=(steps, n, b, 5)).astype(np.float32)
    Y = rng.normal(size=(steps, n, b, 1)).astype(np.float32)
    W0 = [rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(4, 1)).astype(np.float32)]

    def predict(ws, x):  # noqa: ANN001, ANN202
        return tf.matmul(tf.tanh(tf.matmul(x, ws[0])), ws[1])

    def run(distributed: bool, op=hvd.Average, wrap_first: bool = False) -> list:  # noqa: ANN001
        ws = [tf.Variable(w + (r if distributed else 0)) for w in W0]  # rank r starts off; broadcast fixes it
        if distributed:
            hvd.broadcast_variables(ws, root_rank=0)
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.5)

        @tf.function
        def step(x, y):  # noqa: ANN001, ANN202
            if wrap_first:
                with hvd.DistributedGradientTape(tf.GradientTape(), op=op) as tape:
                    loss = tf.reduce_mean(tf.square(predict(ws, x) - y))
            else:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(predict(ws, x) - y))
                if distributed:
                    tape = hvd.DistributedGradientTape(tape, op=op)
            grads = tape.gradient(loss, ws)
            opt.apply_gradients(zip(grads, ws))
            return loss

        for s in range(steps):
            if distributed:
                step(X[s, r], Y[s, r])
            else:
                step(X[s].reshape(n * b, 5), Y[s].reshape(n * b, 1))
        return [w.numpy() for w in ws]

    reference = run(False)
    for wrap_first in (False, True):
        for a, e in zip(run(True, wrap_first=wrap_first), reference):
            close(a, e, f"DistributedGradientTape equivalence wrap_first={wrap_first}", rtol=1e-5, atol=1e-6)
    summed = run(True, op=hvd.Sum)
    assert not np.allclose(summed[0], reference[0]), "op=Sum must differ from Average"
    everyone = hvd.allgather_object([w.tolist() for w in summed])
    assert all(o == everyone[0] for o in everyone), "op=Sum weights differ across ranks"


def test_local_sources_keep_their_size_scaled_local_gradient() -> None:
    local_var, shared_var = tf.Variable(1.0), tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = (local_var + shared_var) * weight
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(local_var)
    g_local, g_shared = tape.gradient(loss, [local_var, shared_var])
    close(g_local, weight / n, "local source gradient")
    close(g_shared, (n + 1) / 2, "shared source gradient")
    layer = tf.keras.layers.Dense(1, kernel_initializer="ones")
    layer.build((None, 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[weight]])))
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer])
    close(ptape.gradient(loss, layer.trainable_weights)[0], [[weight / n]], "PartialDistributedGradientTape")


def test_helpers_on_variables_and_objects() -> None:
    vs = [tf.Variable(np.full(3, r, np.float32)), tf.Variable(r, dtype=tf.int64)]
    hvd.broadcast_variables(vs, root_rank=n - 1)
    close(vs[0], np.full(3, n - 1), "broadcast_variables[0]")
    assert int(vs[1].numpy()) == n - 1

    @tf.function
    def broadcast_in_graph() -> None:
        hvd.broadcast_variables(vs, root_rank=0)

    vs[0].assign(np.full(3, r + 5.0, np.float32))
    broadcast_in_graph()
    close(vs[0], np.full(3, 5.0), "broadcast_variables in tf.function")
    assert hvd.broadcast_object({"rank": r}, root_rank=n - 1) == {"rank": n - 1}
    bcast = hvd.broadcast_object_fn(root_rank=0)
    assert bcast(("from", r)) == ("from", 0)
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]


def test_process_sets() -> None:
    assert isinstance(hvd.global_process_set, hvd.ProcessSet) and hvd.global_process_set.size() == n
    members = [0, 2] if n >= 3 else [1]  # [0, 1] at n=2 would be the global set itself
    pair = hvd.add_process_set(hvd.ProcessSet(members))
    if r in members:
        close(hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum, process_set=pair), [float(sum(members))],
              "process set allreduce")
        close(tf.function(lambda: hvd.allgather(tf.constant([r]), process_set=pair))(), members,
              "process set gather")
        same(int(hvd.size_op(pair.process_set_id)), len(members), "size_op(process set)")
    same(int(hvd.process_set_included_op(pair.process_set_id)), int(r in members), "included_op")
    assert hvd.remove_process_set(pair)


def test_sync_batch_normalization_uses_every_ranks_batch() -> None:
    """Statistics over every rank's batch (of different sizes), eagerly then in tf.function."""
    rows = [np.random.default_rng(100 + k).normal(2.0, 3.0, size=(k + 2, 4)).astype(np.float32) for k in range(n)]
    sync_bn = hvd.SyncBatchNormalization(momentum=0.5)
    plain_bn = tf.keras.layers.BatchNormalization(momentum=0.5)
    for mode, wrap in MODES.items():
        mine = wrap(lambda t: sync_bn(t, training=True))(tf.constant(rows[r]))
        full = plain_bn(tf.constant(np.concatenate(rows)), training=True).numpy()
        first = sum(k + 2 for k in range(r))
        close(mine, full[first:first + r + 2], f"{mode} SyncBatchNormalization output", rtol=1e-4, atol=1e-4)
        close(sync_bn.moving_mean, plain_bn.moving_mean.numpy(), f"{mode} moving mean", rtol=1e-4, atol=1e-4)
        close(sync_bn.moving_variance, plain_bn.moving_variance.numpy(), f"{mode} moving var", rtol=1e-4,
              atol=1e-4)
    assert hvd.SyncBatchNormalization(fused=True).name.startswith("sync_batch_normalization")  # fused: ignored


def test_adasum_and_xla_errors_then_allreduce_still_works() -> None:
    if hvd.size() & (hvd.size() - 1):  # Adasum needs a power-of-two set (test_tf_adasum.py: its values)
        with pytest.raises(ValueError, match="power-of-two"):
            hvd.allreduce(tf.constant([1.0]), op=hvd.Adasum)
    cases = {  # one lambda per line: AutoGraph finds a lambda's source by its line
        "allreduce": lambda t: hvd.allreduce(t),
        "allgather": lambda t: hvd.allgather(t),
        "broadcast": lambda t: hvd.broadcast(t, 0),
    }
    for what, fn in cases.items():
        with pytest.raises(hvd.XLANotSupportedError, match="jit_compile=False") as info:
            tf.function(fn, jit_compile=True)(tf.constant([1.0]))
        assert what in str(info.value) and "XLA" in str(info.value), info.value

    @tf.function(jit_compile=True)
    def xla_step(v):  # noqa: ANN001, ANN202
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        return hvd.DistributedGradientTape(tape).gradient(loss, [v])

    with pytest.raises(hvd.XLANotSupportedError, match="DistributedGradientTape"):
        xla_step(tf.Variable([1.0]))
    close(hvd.allreduce(tf.constant([1.0 + r])), [(n + 1) / 2], "allreduce still works after the XLA error")


def test_timeline_then_shutdown(tmp_path: Path) -> None:
    timeline_path = hvd.broadcast_object(str(tmp_path / "timeline.json"), root_rank=0)
    hvd.start_timeline(timeline_path)
    hvd.allreduce(tf.constant([1.0]), name="timeline.tensor")
    hvd.stop_timeline()
    if r == 0:
        assert os.path.getsize(timeline_path) > 0 and "timeline.tensor" in Path(timeline_path).read_text()
    hvd.shutdown()
    assert not hvd.is_initialized()
