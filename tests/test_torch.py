"""hvdlite.torch in one process: Horovod's API surface and signatures, zero-copy tensors, dtypes, optimizer."""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest
import torch

import hvdlite.torch as hvd
from hvdlite.core import NotInitializedError
from hvdlite.torch.tensors import to_host

REQ = inspect.Parameter.empty
PS = hvd.global_process_set
NONE = hvd.Compression.none
_RED = [("average", None), ("name", None), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0),
        ("process_set", PS)]
_RS = [("name", None), ("op", hvd.Average), ("process_set", PS), ("prescale_factor", 1.0),
       ("postscale_factor", 1.0)]
#: horovod.torch's signatures: (parameter, default) in order.
HOROVOD_SIGNATURES = {
    "init": [("comm", None), ("process_sets", None)],
    "allreduce": [("tensor", REQ), ("average", None), ("name", None), ("compression", NONE), ("op", None),
                  ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", PS)],
    "allreduce_async": [("tensor", REQ)] + _RED, "allreduce_": [("tensor", REQ)] + _RED,
    "allreduce_async_": [("tensor", REQ)] + _RED,
    "grouped_allreduce": [("tensors", REQ), ("average", None), ("name", None), ("compression", NONE),
                          ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", PS)],
    "grouped_allreduce_async": [("tensors", REQ)] + _RED, "grouped_allreduce_": [("tensors", REQ)] + _RED,
    "grouped_allreduce_async_": [("tensors", REQ)] + _RED,
    "sparse_allreduce_async": [("tensor", REQ), ("name", REQ), ("op", REQ), ("process_set", PS)],
    "allgather": [("tensor", REQ), ("name", None), ("process_set", PS)],
    "allgather_async": [("tensor", REQ), ("name", None), ("process_set", PS)],
    "grouped_allgather": [("tensors", REQ), ("name", None), ("process_set", PS)],
    "grouped_allgather_async": [("tensors", REQ), ("name", None), ("process_set", PS)],
    "broadcast": [("tensor", REQ), ("root_rank", REQ), ("name", None), ("process_set", PS)],
    "broadcast_": [("tensor", REQ), ("root_rank", REQ), ("name", None), ("process_set", PS)],
    "broadcast_async": [("tensor", REQ), ("root_rank", REQ), ("name", None), ("process_set", PS)],
    "broadcast_async_": [("tensor", REQ), ("root_rank", REQ), ("name", None), ("process_set", PS)],
    "alltoall": [("tensor", REQ), ("splits", None), ("name", None), ("process_set", PS)],
    "alltoall_async": [("tensor", REQ), ("splits", None), ("name", None), ("process_set", PS)],
    "reducescatter": [("tensor", REQ), ("name", None), ("compression", NONE), ("op", hvd.Average),
                      ("process_set", PS), ("prescale_factor", 1.0), ("postscale_factor", 1.0)],
    "reducescatter_async": [("tensor", REQ)] + _RS,
    "grouped_reducescatter": [("tensors", REQ), ("name", None), ("compression", NONE), ("op", hvd.Average),
                              ("process_set", PS), ("prescale_factor", 1.0), ("postscale_factor", 1.0)],
    "grouped_reducescatter_async": [("tensors", REQ)] + _RS,
    "join": [("device", -1)], "barrier": [("process_set", PS)], "poll": [("handle", REQ)],
    "synchronize": [("handle", REQ)], "start_timeline": [("file_path", REQ), ("mark_cycles", False)],
    "stop_timeline": [], "add_process_set": [("process_set", REQ)], "remove_process_set": [("process_set", REQ)],
    "broadcast_parameters": [("params", REQ), ("root_rank", REQ)],
    "broadcast_optimizer_state": [("optimizer", REQ), ("root_rank", REQ), ("model", None), ("process_set", PS)],
    "broadcast_object": [("obj", REQ), ("root_rank", 0), ("name", None), ("process_set", PS)],
    "allgather_object": [("obj", REQ), ("name", None), ("process_set", PS)],
    "DistributedOptimizer": [("optimizer", REQ), ("named_parameters", None), ("compression", NONE),
                             ("backward_passes_per_step", 1), ("op", hvd.Average),
                             ("gradient_predivide_factor", 1.0), ("num_groups", 0), ("groups", None),
                             ("sparse_as_dense", False),
                             ("process_set", PS)],
    "SyncBatchNorm": [("num_features", REQ), ("eps", 1e-5), ("momentum", 0.1), ("affine", True),
                      ("track_running_stats", True)],
}
NO_ARGS = ["shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built"]
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    was_initialized = hvd.is_initialized()
    hvd.init()
    yield
    if not was_initialized:  # leave the pytest process as this module found it
        hvd.shutdown()


@pytest.mark.parametrize("name", sorted(HOROVOD_SIGNATURES))
def test_horovod_signature(name: str) -> None:
    obj = getattr(hvd, name)
    params = list(inspect.signature(obj).parameters.values())
    expected = HOROVOD_SIGNATURES[name]
    assert [(p.name, p.default) for p in params[:len(expected)]] == expected
    for extra in params[len(expected):]:  # hvdlite may only add optional trailing arguments
        assert extra.default is not REQ or extra.kind is inspect.Parameter.VAR_KEYWORD, extra


def test_every_other_name_exists() -> None:
    for name in NO_ARGS:
        assert callable(getattr(hvd, name)) and not [
            p for p in inspect.signature(getattr(hvd, name)).parameters.values() if p.default is REQ], name
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
                 "HorovodInternalError", "Compression"):
        assert hasattr(hvd, name), name
    assert {hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16}
    assert hvd.HorovodInternalError is hvd.HvdliteError
    assert set(hvd.__all__) >= set(HOROVOD_SIGNATURES) | set(NO_ARGS)


def test_calls_before_init_say_to_call_init() -> None:
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        with pytest.raises(NotInitializedError, match="init"):
            hvd.rank()
        with pytest.raises(NotInitializedError, match="init"):
            hvd.allreduce(torch.ones(2))
        with pytest.raises(NotInitializedError, match="init"):
            hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
    finally:
        hvd.init()
    assert hvd.size() == 1 and hvd.rank() == 0


def test_cpu_tensors_reach_numpy_without_a_copy() -> None:
    for dtype in DTYPES:
        t = torch.ones(3, 4, dtype=dtype)
        array, shared = to_host(t, "test")
        assert shared and array.__array_interface__["data"][0] == t.data_ptr(), dtype
    strided = torch.ones(4, 6)[:, ::2]
    array, shared = to_host(strided, "test")
    assert shared and np.shares_memory(array, strided.numpy())
    t = torch.arange(6, dtype=torch.float32)
    ptr = t.data_ptr()
    assert hvd.allreduce_(t, op=hvd.Sum, prescale_factor=2.0) is t and t.data_ptr() == ptr
    assert torch.equal(t, torch.arange(6, dtype=torch.float32) * 2)


def test_the_per_tensor_submit_path_follows_the_tensors_memory() -> None:
    """allreduce_async_ keeps each tensor's view, dtype and layout (tensors.prepared): a .data swap (new dtype and
    shape), resize_ and set_ must each reach the new memory (prescale 2 doubles what the engine reduces; a stale
    view would double the old memory), and the kept entry must neither hold the tensor alive nor outlive it."""
    import gc
    import weakref
    from hvdlite.torch import tensors
    t = torch.arange(4, dtype=torch.float32)
    for _ in range(2):  # the second call takes the kept entry
        assert hvd.synchronize(hvd.allreduce_async_(t, name="kept", op=hvd.Sum, prescale_factor=2.0)) is t
    assert torch.equal(t, torch.arange(4, dtype=torch.float32) * 4)
    old = t.data
    t.data = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    assert hvd.synchronize(hvd.allreduce_async_(t, name="kept", op=hvd.Sum, prescale_factor=2.0)) is t
    assert t.dtype == torch.float64 and torch.equal(t, torch.arange(6, dtype=torch.float64).reshape(2, 3) * 2)
    assert torch.equal(old, torch.arange(4, dtype=torch.float32) * 4)  # the old memory was left alone
    t.resize_(8).fill_(1.0)
    assert torch.equal(hvd.synchronize(hvd.allreduce_async_(t, name="kept.8", op=hvd.Sum, prescale_factor=2.0)),
                       torch.full((8,), 2.0, dtype=torch.float64))
    other = torch.full((8,), 5.0, dtype=torch.float64)
    t.set_(other)
    hvd.synchronize(hvd.allreduce_async_(t, name="kept.8", op=hvd.Sum, prescale_factor=2.0))
    assert torch.equal(other, torch.full((8,), 10.0, dtype=torch.float64))
    alive, key = weakref.ref(t), id(t)
    assert key in tensors._ENTRIES
    del t, other
    gc.collect()
    assert alive() is None and key not in tensors._ENTRIES


def test_an_unnamed_allreduce_async_keeps_its_input_alive_with_its_handle() -> None:
    """The unnamed op reads its input through the view prepared() caches, which does not hold the tensor: the
    handle does, so a temporary input's memory stays the engine's to read until the handle goes."""
    import gc
    import weakref
    t = torch.arange(6, dtype=torch.float32) * 2
    alive = weakref.ref(t)
    handle = hvd.allreduce_async(t, op=hvd.Sum)
    del t
    gc.collect()
    assert alive() is not None
    assert torch.equal(hvd.synchronize(handle), torch.arange(6, dtype=torch.float32) * 2 * hvd.size())
    assert alive() is not None
    del handle
    for _ in range(200):  # the engine thread may drop its last local reference a cycle after the handle completed
        gc.collect()
        if alive() is None:
            break
        time.sleep(0.01)
    assert alive() is None


def test_a_tensor_reinterpreted_in_place_is_viewed_in_its_new_dtype() -> None:
    """A .data swap to a view of another dtype keeps the address, shape and strides: the kept entry (one per
    tensor, for to_host's view and the small-op path alike) must see the dtype change too."""
    t = torch.arange(4, dtype=torch.float32)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), t)  # to_host's view of t is kept
    t.data = t.data.view(torch.int32)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), t)  # a stale float32 view would give 0, 1, 2, 3
    assert hvd.synchronize(hvd.allreduce_async_(t, name="reinterpreted", op=hvd.Sum)) is t
    assert t.dtype == torch.int32 and torch.equal(t.view(torch.float32), torch.arange(4, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_in_every_collective(dtype: torch.dtype) -> None:
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    op = hvd.Max if dtype == torch.bool else hvd.Sum
    for out in (hvd.allreduce(t, op=op), hvd.allgather(t), hvd.broadcast(t, 0), hvd.alltoall(t),
                hvd.synchronize(hvd.allreduce_async(t.t(), op=op)).t()):
        assert out.dtype == dtype and torch.equal(out, t)
    if dtype != torch.bool:
        assert torch.equal(hvd.reducescatter(t, op=hvd.Sum), t)
    if dtype.is_floating_point:
        assert torch.equal(hvd.allreduce(t), t)  # Average over one rank


def test_unsupported_tensors_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="complex128 are not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex128))
    with pytest.raises(TypeError, match="sparse_allreduce_async"):
        hvd.allreduce(torch.ones(2).to_sparse())
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        hvd.allreduce(np.ones(2))
    with pytest.raises(TypeError, match="synchronize"):
        hvd.synchronize(42)


#: Every torch op that takes tensors, with its other required arguments.
TENSOR_OPS = {name: (0,) if name.startswith("broadcast") else () for name in HOROVOD_SIGNATURES
              if list(inspect.signature(getattr(hvd, name)).parameters)[:1] in (["tensor"], ["tensors"])}


def test_every_op_given_a_bad_argument_raises_a_type_error_naming_itself() -> None:
    """The op the user called, not the one it delegates to, and what it got: a non-tensor, an unsupported
    dtype, and, for a grouped op, something that is not a list of tensors."""
    complex_tensor = torch.ones(2, dtype=torch.complex64)
    wrong = []
    for name, args in sorted(TENSOR_OPS.items()):
        op, grouped = getattr(hvd, name), name.startswith("grouped_")
        if name == "sparse_allreduce_async":
            cases = [("not a tensor", "expected a sparse COO torch.Tensor, got str"),
                     (torch.ones(2), "expected a sparse COO torch.Tensor, got a torch.strided tensor")]
            args = ("n", hvd.Sum)
        else:
            cases = [("not a tensor", "expected a torch.Tensor, got str"),
                     (complex_tensor, "tensors of dtype torch.complex64 are not supported by hvdlite")]
            cases = [([bad], message) for bad, message in cases] if grouped else cases
            cases += [("abc", "expected a list of torch.Tensors, got str")] if grouped else []
        for bad, message in cases:
            try:
                op(bad, *args)
                wrong.append(f"{name}({bad!r}): no error")
            except Exception as exc:  # noqa: BLE001 - every kind is checked below
                if type(exc) is not TypeError or not str(exc).startswith(f"{name}: {message}"):
                    wrong.append(f"{name}({bad!r}): {type(exc).__name__}: {exc}")
    assert len(TENSOR_OPS) == 23 and not wrong, "\n".join(wrong)


def test_compression_round_trip() -> None:
    x = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    for comp, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        sent, ctx = comp.compress(x)
        assert sent.dtype == wire and torch.equal(comp.decompress(sent, ctx), x)
        ints = torch.arange(3)
        sent, ctx = comp.compress(ints)
        assert sent is ints and comp.decompress(sent, ctx) is ints
    sent, ctx = hvd.Compression.none.compress(x)
    assert sent is x and hvd.Compression.none.decompress(sent, ctx) is x


def test_distributed_optimizer_keeps_the_class_state_and_torch_hooks() -> None:
    model = torch.nn.Linear(3, 2)
    base = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    base.step()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    assert opt.state is base.state and opt.param_groups is base.param_groups and len(opt.state) == 2
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    scheduler.step()
    assert calls == ["pre"] and not torch.equal(model.weight, before)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.state[model.weight]["step"].item() == 2
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def test_sync_batch_norm_matches_batch_norm_on_one_rank() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4)
    ref, sync = torch.nn.BatchNorm1d(3), hvd.SyncBatchNorm(3)
    sync.load_state_dict(ref.state_dict())
    assert torch.allclose(sync(x), ref(x), atol=1e-6)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-6)
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(x), ref(x), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2D"):
        sync(torch.ones(3))


def test_an_abandoned_nccl_plane_aborts_its_communicator_and_never_waits_past_abort_wait_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a lost rank, the failed job's NCCL communicator is aborted (TorchPlane.abandon, from the unclean
    close of the planes), so that no collective stays hung on the GPU; an abort that hangs is left behind after
    ABORT_WAIT_S, with a warning naming the rank and set, and the recovery goes on. Gloo groups are not aborted.
    The groups here stand in for ProcessGroupNCCL, which this CPU-only torch lacks: tests/gpu_check.py aborts a
    real one on a GPU and makes a new one in the same process."""
    import logging
    import threading
    import time

    from hvdlite.core.frontend import Bootstrap
    from hvdlite.torch import plane as torch_plane

    class Group:
        def __init__(self, hang: bool) -> None:
            self.calls, self.hang, self.release = 0, hang, threading.Event()

        def abort(self) -> None:
            self.calls += 1
            if self.hang:
                self.release.wait(30)

    boot = Bootstrap(3, 0, 1, None, 5, True)
    nccl, gloo = Group(False), Group(False)
    torch_plane.TorchPlane("nccl", nccl, boot).abandon()
    torch_plane.TorchPlane("gloo", gloo, boot).abandon()
    assert (nccl.calls, gloo.calls) == (1, 0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(torch_plane.__name__).addHandler(handler)
    monkeypatch.setattr(torch_plane, "ABORT_WAIT_S", 0.3)
    hung = Group(True)
    started = time.monotonic()
    try:
        torch_plane.TorchPlane("nccl", hung, boot).abandon()
        took = time.monotonic() - started
    finally:
        hung.release.set()
        logging.getLogger(torch_plane.__name__).removeHandler(handler)
    assert hung.calls == 1 and 0.3 <= took < 5, took
    assert [r.getMessage() for r in records] == [
        "rank 5: aborting the NCCL communicator of process set 3 took over 0.3 s; going on without it (its GPU "
        "resources stay until the process exits)"]


def test_ctrl_c_line_names_the_users_frame() -> None:
    """The one line a rank prints on Ctrl-C names the user's own line, not the torch frame it was in (there the
    innermost frame outside hvdlite was torch/nn/modules/linear.py's)."""
    from hvdlite.core.abort import users_line
    try:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        torch.nn.Linear(2, 2)(torch.ones(3))
    except RuntimeError as exc:
        tb = exc.__traceback__
    assert "torch" in [*inspect.getinnerframes(tb)][-1].filename  # the innermost Python frame is torch's
    assert users_line(tb) == f"{__file__}:{line}"
