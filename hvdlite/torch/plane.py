"""The torch.distributed data plane: NCCL for CUDA tensors, gloo for CPU ones, bootstrapped over hvdlite's MPI.

Each plane is a ProcessGroup of its own (never torch.distributed's default group), called by the engine thread only.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import socket
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvdlite.core import ReduceOp
from hvdlite.core.frontend import (Bootstrap, DataPlane, PlaneFactory, accumulated_allreduce, exact_divisor,
                                   in_rank_order, mpi_cuda_aware, rank_order_allreduce, register_factory,
                                   register_gpu_probe)

from . import mpi_plane

#: How long a plane's collective may wait before torch itself gives up; hvdlite's stall inspector
#: (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) normally ends a wedged job long before.
GROUP_TIMEOUT = datetime.timedelta(hours=2)
#: How long a failed job's NCCL abort is waited for before the recovery goes on without it (TorchPlane.abandon)
ABORT_WAIT_S = 10.0
_log = logging.getLogger(__name__)

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT, ReduceOp.AVERAGE: dist.ReduceOp.SUM}
#: bool travels as uint8: Sum is a logical or (Max), Product a logical and (Min), as on the MPI path.
_BOOL_OPS = {ReduceOp.SUM: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.MIN, ReduceOp.MIN: dist.ReduceOp.MIN,
             ReduceOp.MAX: dist.ReduceOp.MAX}
TORCH_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.bool)}
#: dtypes gloo and NCCL reduce (others stay on hvdlite's MPI path: host buffers, or host staging on GPUs).
PLANE_DTYPES = frozenset(TORCH_DTYPES) - {"int16"}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def scale_in_place(t: torch.Tensor, factor: float) -> None:
    """Multiply in place with the MPI path's rounding (hvdlite.core.reduce_ops.scale_inplace): float32 and
    half precision by the factor rounded to float32, in float32; float64 in double; integers in float64,
    truncated toward zero; a plain Average divides by the set size."""
    if factor == 1.0 or t.numel() == 0:
        return
    divisor = exact_divisor(factor)
    if divisor != 1 and t.dtype in (torch.float16, torch.bfloat16):  # a plain Average divides (as scale_inplace)
        t.copy_(t.float() / divisor)
    elif divisor != 1 and t.dtype.is_floating_point:
        t.div_(divisor)
    elif t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        wide = t.float()
        wide *= torch.tensor(float(factor), dtype=torch.float32, device=t.device)
        t.copy_(wide)
    elif t.dtype.is_floating_point:
        t.mul_(float(factor))
    else:
        t.copy_((t.double() / divisor if divisor != 1 else t.double() * float(factor)).trunc())


class TorchPlane(DataPlane):
    """One torch.distributed ProcessGroup among one process set's members."""

    def __init__(self, name: str, group: Any, boot: Bootstrap) -> None:
        self.name = name
        self.group = group
        self.boot = boot
        self.rank = boot.rank
        self.size = boot.size
        self._checked_devices = False
        self._waits: list = []  # producing streams' events, waited for on the batch's device (see _device)
        self._gpu: Any = None  # this rank's GPU, once a CUDA batch has named it

    # -- ordering and waiting -------------------------------------------------------------------------
    def wait_ready(self, events: list) -> None:
        """The GPU waits for the producing streams (in _device, on the batch's device: the engine thread's own
        current device is not the rank's); the host does not, except for MPI, which the host drives."""
        if self.name == mpi_plane.NAME:
            for event in events:
                self.boot.wait(event.query)
        else:
            self._waits = list(events)

    def _run(self, work: Any) -> None:
        """Wait for one torch Work: CUDA work is stream-ordered (the engine stream waits on NCCL's, and
        completion is awaited once per batch in _done); CPU work is polled like an MPI request; None (the MPI
        plane's calls block) is done."""
        if work is None:
            return
        if self.name != "nccl":
            self.boot.wait(work.is_completed)
        work.wait()  # raises the backend's error, if any

    def _done(self, tensors: list) -> None:
        """Before the batch's handles complete: the collective and the copies after it have run on the GPU
        (an event polled like an MPI request: no device-wide synchronize, and the stall watch runs)."""
        if tensors and tensors[0].is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.boot.wait(event.query)

    def _device(self, tensors: list) -> Any:
        first = tensors[0] if tensors else None
        if first is not None and first.is_cuda:
            self._check_devices(first.device)
            self._gpu = first.device
            for event in self._waits:
                torch.cuda.current_stream(first.device).wait_event(event)
            self._waits = []
            return torch.cuda.device(first.device)
        return contextlib.nullcontext()

    def _check_devices(self, device: Any) -> None:
        """Once, at the first CUDA batch (a batch every member runs): NCCL refuses two ranks on one GPU."""
        if self._checked_devices or self.name != "nccl":
            return
        self._checked_devices = True
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        seen = self.boot.allgather((socket.gethostname(), uuid, device.index))
        owners: dict[tuple, list[int]] = {}
        for rank, (host, gpu, _) in enumerate(seen):
            owners.setdefault((host, gpu), []).append(rank)
        shared = {key: ranks for key, ranks in owners.items() if len(ranks) > 1}
        if shared:
            detail = "; ".join(f"ranks {ranks} all use GPU {seen[ranks[0]][2]} of host {host}"
                               for (host, _), ranks in shared.items())
            raise RuntimeError(
                f"NCCL needs one GPU per rank, but {detail} (process set {self.boot.ps_id}). Give each rank its "
                f"own GPU (torch.cuda.set_device(hvd.local_rank()), srun --gpus-per-task=1), or run these ranks "
                f"through host staging with HOROVOD_GPU_OPERATIONS=MPI")

    # -- collectives ----------------------------------------------------------------------------------
    def allreduce(self, inputs: list, outputs: list, dtype: str, op: ReduceOp, pre: float,
                  post: float) -> list:
        with self._device(inputs):
            out = outputs[0] if len(inputs) == 1 else None
            if len(inputs) > 1:
                buf = torch.cat([t.reshape(-1) for t in inputs])  # one flat fusion buffer on the plane's device
            else:  # one tensor: reduced in its output's memory, or in a copy
                buf = inputs[0].clone() if out is None else out if out is inputs[0] else out.copy_(inputs[0])
            scale_in_place(buf, pre)
            self._allreduce_flat(buf, dtype, op)
            scale_in_place(buf, post)
            if len(inputs) > 1:
                return self._unflatten(buf, inputs, outputs)
            self._done([buf])
            return [buf]

    def allreduce_accumulated(self, inputs: list, outputs: list, dtype: str, acc: Any, pre: float,
                              post: float) -> list:
        """bf16/fp16 on the wire, float32 sums: the core's accumulated_allreduce over this plane's moves."""
        with self._device(inputs):
            flat = torch.cat([t.reshape(-1).double() if pre != 1.0 else t.reshape(-1).float() for t in inputs])
            if pre != 1.0:  # float32(double(x) * pre): the MPI path's rounding
                flat = (flat * float(pre)).float()
            reduced = accumulated_allreduce(self, self.boot, flat, acc, post, lambda t, d: t.to(TORCH_DTYPES[d]))
            return self._unflatten(reduced, inputs, outputs)

    def _unflatten(self, flat: torch.Tensor, inputs: list, outputs: list) -> list:
        """The reduced flat buffer as one result per input (its shape and dtype), into ``outputs`` where given."""
        pieces = [piece.view(t.shape).to(t.dtype)  # no copy where the dtype is t's
                  for t, piece in zip(inputs, flat.split([t.numel() for t in inputs]))]
        results = [piece if out is None else out.copy_(piece) for piece, out in zip(pieces, outputs)]
        self._done(results)
        return results

    def _allreduce_flat(self, buf: torch.Tensor, dtype: str, op: ReduceOp) -> None:
        if in_rank_order(self.boot, dtype, op):  # deterministic=True: the core's rank-order rule, not the backend's
            rank_order_allreduce(self, self.boot, buf, op)
            return
        options: Any = dist.AllreduceOptions()
        if dtype == "bool":
            options.reduceOp = _BOOL_OPS[op]
            buf = buf.view(torch.uint8)
        else:
            options.reduceOp = _OPS[op]
        self._run(self.group.allreduce([buf], options))

    def allgather(self, inputs: list, rows: list[list[int]]) -> list:
        with self._device(inputs):
            per_row = [math.prod(t.shape[1:]) * t.element_size() for t in inputs]
            most = [max(r[i] for r in rows) for i in range(len(inputs))]
            slots = [m * b for m, b in zip(most, per_row)]
            block = sum(slots)
            send = torch.zeros(block, dtype=torch.uint8, device=inputs[0].device)
            for t, slot in zip(inputs, send.split(slots)):
                slot[:t.nbytes].copy_(as_bytes(t))
            recv = torch.empty(block * self.size, dtype=torch.uint8, device=send.device)
            self._run(self.group._allgather_base(recv, send))
            results = []
            for i, (t, slot) in enumerate(zip(inputs, recv.view(self.size, block).split(slots, dim=1))):
                pieces = [slot[r, :rows[r][i] * per_row[i]] for r in range(self.size)]  # each rank's rows
                whole = torch.cat(pieces).view(t.dtype) if per_row[i] else torch.empty(0, dtype=t.dtype,
                                                                                       device=t.device)
                results.append(whole.reshape((sum(r[i] for r in rows),) + tuple(t.shape[1:])))
            self._done(results)
            return results

    def broadcast(self, inputs: list, outputs: list, root: int) -> list:
        with self._device(inputs):
            results = []
            for t, out in zip(inputs, outputs):
                if out is None:
                    out = t.clone()
                elif out is not t and self.rank == root:
                    out.copy_(t)
                results.append(out)
            options = dist.BroadcastOptions()
            options.rootRank = root
            if len(results) == 1:
                self._run(self.group.broadcast([as_bytes(results[0])], options))
            else:
                buf = torch.cat([as_bytes(t) for t in results])
                self._run(self.group.broadcast([buf], options))
                for t, piece in zip(results, buf.split([t.nbytes for t in results])):
                    as_bytes(t).copy_(piece)
            self._done(results)
            return results

    def alltoall(self, tensor: Any, send_splits: list[int], recv_splits: list[int]) -> Any:
        with self._device([tensor]):
            out = torch.empty((sum(recv_splits),) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                              device=tensor.device)
            wire_in, wire_out = (tensor.view(torch.uint8), out.view(torch.uint8)) if tensor.dtype == torch.bool \
                else (tensor, out)
            self._run(self.group.alltoall_base(wire_out, wire_in, recv_splits, send_splits,
                                               dist.AllToAllOptions()))
            self._done([out])
            return out

    def reducescatter(self, inputs: list, dtype: str, op: ReduceOp, pre: float, post: float,
                      splits: list[list[int]]) -> list:
        with self._device(inputs):
            elems = [t[0].numel() if t.shape[0] else 0 for t in inputs]
            pieces, counts = [], []
            for r in range(self.size):  # rank-major: rank r's rows of every tensor, then rank r+1's...
                count = 0
                for t, s, e in zip(inputs, splits, elems):
                    lo = sum(s[:r])
                    pieces.append(t[lo:lo + s[r]].reshape(-1))
                    count += s[r] * e
                counts.append(count)
            send = torch.cat(pieces)
            scale_in_place(send, pre)
            ordered = in_rank_order(self.boot, dtype, op)  # deterministic=True: through _allreduce_flat's rank order
            if len(set(counts)) == 1 and dtype != "bool" and self.name == "nccl" and not ordered:
                mine = torch.empty(counts[0], dtype=send.dtype, device=send.device)
                options: Any = dist.ReduceScatterOptions()
                options.reduceOp = _OPS[op]
                self._run(self.group._reduce_scatter_base(mine, send, options))
            else:  # uneven shares (or gloo, whose reduce-scatter work never reports completion when polled):
                # reduce everything, keep this rank's part
                self._allreduce_flat(send, dtype, op)
                start = sum(counts[:self.rank])
                mine = send[start:start + counts[self.rank]]
            scale_in_place(mine, post)
            shares = mine.split([s[self.rank] * e for s, e in zip(splits, elems)])
            results = [share.view((s[self.rank],) + tuple(t.shape[1:])) for t, s, share in zip(inputs, splits, shares)]
            self._done(results)
            return results

    def zeros(self, dtype: str, shape: tuple) -> Any:
        on_gpu = self.name == "nccl" or (self.name == mpi_plane.NAME and torch.cuda.is_available())
        device = (self._gpu or torch.device("cuda", torch.cuda.current_device())) if on_gpu else "cpu"
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=device)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if self.name != "gloo" and shutdown is not None:
            shutdown()
        self.group = None

    def abandon(self) -> None:
        """A failed job's NCCL communicator is aborted (ncclCommAbort): a kernel left waiting for a dead peer
        would hold back all later work on the rank's streams. In a thread, waited for up to ABORT_WAIT_S. Gloo
        and MPI groups need nothing (their waits end with the failure)."""
        abort = getattr(self.group, "abort", None)
        if self.name != "nccl" or abort is None:
            return
        thread = threading.Thread(target=abort, name="hvdlite-nccl-abort", daemon=True)
        thread.start()
        thread.join(ABORT_WAIT_S)
        if thread.is_alive():
            _log.warning("rank %d: aborting the NCCL communicator of process set %d took over %g s; going on "
                         "without it (its GPU resources stay until the process exits)", self.boot.world_rank,
                         self.boot.ps_id, ABORT_WAIT_S)


class TorchPlanes(PlaneFactory):
    """Registered when hvdlite.torch is imported: offers gloo, NCCL and CUDA-aware MPI where they work."""

    def __init__(self) -> None:
        self._store: Optional[Any] = None
        #: (CUDA-aware, how that was found) for this process's MPI, asked at init() (None before)
        self.mpi_cuda: Optional[tuple[bool, str]] = None
        self.mpi_cuda_offered = False  # whether this rank offered the CUDA-aware MPI plane at init()

    def built(self, what: str) -> bool:
        if what == "cuda":
            return torch.backends.cuda.is_built()
        if not dist.is_available():
            return False
        if what == "nccl":
            return dist.is_nccl_available() and torch.backends.cuda.is_built()
        return what == "gloo" and dist.is_gloo_available()

    def available(self, settings: Any) -> list[str]:
        names = []
        gpu = {settings.gpu_operations}
        if self.built("gloo") and (settings.cpu_operations == "gloo" or "gloo" in gpu):
            names.append("gloo")
        if self.built("nccl") and torch.cuda.is_available() and gpu & {"", "nccl"}:
            names.append("nccl")
        self.mpi_cuda = mpi_cuda_aware(settings.mpi_cuda_aware)
        # offered where CUDA tensors can exist (or mpi_cuda_aware=on says to) and a setting may choose it
        self.mpi_cuda_offered = self.mpi_cuda[0] and bool(gpu & {"", "mpi"}) \
            and (torch.cuda.is_available() or settings.mpi_cuda_aware == "on")
        if self.mpi_cuda_offered:
            names.append(mpi_plane.NAME)
        return names

    def make(self, name: str, boot: Bootstrap) -> TorchPlane:
        if name == mpi_plane.NAME:
            return TorchPlane(name, mpi_plane.MPIGroup(boot), boot)
        store = dist.PrefixStore(f"hvdlite/{name}/{boot.ps_id}/", self._rendezvous(boot))
        group: Any
        if name == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = GROUP_TIMEOUT
            group = dist.ProcessGroupNCCL(store, boot.rank, boot.size, options)
        else:
            group = dist.ProcessGroupGloo(store, boot.rank, boot.size, GROUP_TIMEOUT)
        return TorchPlane(name, group, boot)

    def _rendezvous(self, boot: Bootstrap) -> Any:
        """The job's one store: world rank 0 serves it on a free port, told to the others over MPI (made with
        the world's planes, the first set; later sets use prefixes of it)."""
        if self._store is None:
            host = "127.0.0.1" if boot.single_host else socket.gethostbyname(socket.gethostname())
            if boot.rank == 0:
                self._store = dist.TCPStore(host, 0, boot.size, True, timeout=GROUP_TIMEOUT,
                                            wait_for_workers=False)
                boot.bcast((host, self._store.port))
            else:
                host, port = boot.bcast(None)
                self._store = dist.TCPStore(host, port, boot.size, False, timeout=GROUP_TIMEOUT)
        return self._store

    def closing(self, boot: Bootstrap) -> None:
        boot.allgather(None)  # every rank's groups are gone before rank 0 stops serving the store
        self._store = None

    def forget(self) -> None:
        self._store = None  # the abandoned groups keep their store; the next init() opens a new one


FACTORY = TorchPlanes()
register_factory(FACTORY)
register_gpu_probe("torch", torch.cuda.is_available)

__all__ = ["TorchPlane", "TorchPlanes", "FACTORY", "PLANE_DTYPES", "TORCH_DTYPES"]
