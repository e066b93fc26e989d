"""Running a batch on a data plane: the agreed metadata (row counts, splits) travels over MPI, the bytes
over the plane (engine/execution.py hands a batch here when its requests name a plane)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import HvdliteError
from .planes import DataPlane, PlaneTable
from ..reduce_ops import ACCUMULABLE_DTYPES, Accumulation, Adasum, Average, average_scale, resolve_op
from . import deterministic, mpi, polling, row_exec
from .fusion import Item
from .requests import Kind
from .timeline import Timeline


class PlaneExecutor:
    """One method per kind, as the MPI executor; each returns (item, result) pairs."""

    def __init__(self, table: Optional[PlaneTable], comm_of: Callable[[int], Any],
                 members_of: Callable[[int], list[int]], timeline: Timeline,
                 job_ends: type[BaseException] = HvdliteError) -> None:
        self.table = table
        self.members_of = members_of
        self.job_ends = job_ends  # what ends the engine anyway (a wedged wait inside a plane included)
        self.comm_of = comm_of
        self.timeline = timeline
        self._table = {Kind.ALLREDUCE: self._allreduce, Kind.ALLGATHER: self._allgather,
                       Kind.BROADCAST: self._broadcast, Kind.REDUCESCATTER: self._reducescatter,
                       Kind.ALLTOALL: self._alltoall}

    def set_changed(self, added: bool, ps_id: int, comm: Any) -> None:
        """A process set was added or removed: its planes are made or closed with it (one plane per set)."""
        if self.table is not None:
            self.table.set_changed(added, ps_id, comm)

    def run(self, batch: list[Item]) -> list[tuple[Item, Any]]:
        first = batch[0].resp
        assert self.table is not None, "a batch names a data plane but the engine has no plane table"
        plane = self.table.plane(first.sig.plane, first.sig.ps_id)
        for item in batch:
            if item.req is None:  # a joined rank stands in with zeros (no rows for allgather)
                item.src = plane.zeros(item.dtype, item.src.shape)
                item.dst = None
            self.timeline.begin(item.resp.name, f"{plane.name.upper()}_{first.sig.kind.label.upper()}")
        ready = [getattr(item.src, "ready", None) for item in batch]
        plane.wait_ready([event for event in ready if event is not None])
        try:
            results = self._table[first.sig.kind](plane, batch)
        except (HvdliteError, self.job_ends):
            raise
        except Exception as exc:  # noqa: BLE001 - the plane is in an unknown state: the job ends, as after a
            # failed MPI call, with the plane's error on this rank (its peers' waits end in the StallError)
            if mpi.is_process_failure(exc):  # a lost peer (ULFM), seen by the stall watch of the plane's wait
                raise
            raise HvdliteError(plane_failure(self.table.world_rank, plane.name, batch, exc)) from exc
        finally:
            for item in batch:
                self.timeline.end(item.resp.name)
        return list(zip(batch, results))

    def _payloads(self, batch: list[Item]) -> list[Any]:
        return [_payload(item.src) for item in batch]

    def _allreduce(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        sig = batch[0].resp.sig
        op = resolve_op(sig.op)
        if op is Adasum:
            raise NotImplementedError("hvd.Adasum runs on MPI host buffers only; reduce these tensors with "
                                      "hvd.Average or hvd.Sum, or move them to the CPU")
        post = average_scale(sig.postscale, self._size(batch)) if op is Average else sig.postscale
        outputs = [None if item.dst is None else _payload(item.dst) for item in batch]
        if type(sig.extra) is Accumulation and batch[0].dtype in ACCUMULABLE_DTYPES:  # engine/accumulate.py's rule
            return plane.allreduce_accumulated(self._payloads(batch), outputs, batch[0].dtype, sig.extra,
                                               sig.prescale, post)
        return plane.allreduce(self._payloads(batch), outputs, batch[0].dtype, op, sig.prescale, post)

    def _allgather(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        all_rows = row_exec.row_counts(self.comm_of(batch[0].resp.sig.ps_id), batch, polling.wait)
        return plane.allgather(self._payloads(batch), all_rows.tolist())

    def _broadcast(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        outputs = [None if item.dst is None else _payload(item.dst) for item in batch]
        first = batch[0].resp
        root = self.members_of(first.sig.ps_id).index(first.sig.root)  # the job's rank -> the set's (agreed valid)
        return plane.broadcast(self._payloads(batch), outputs, root)

    def _reducescatter(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        sig = batch[0].resp.sig
        op = resolve_op(sig.op)
        n = self._size(batch)
        post = average_scale(sig.postscale, n) if op is Average else sig.postscale
        splits = [deterministic.slices(item.src.shape[0], n) for item in batch]  # as the MPI path's
        results = plane.reducescatter(self._payloads(batch), batch[0].dtype, op, sig.prescale, post, splits)
        return results

    def _alltoall(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        item = batch[0]
        splits, recv = row_exec.splits_of(self.comm_of(item.resp.sig.ps_id), item, polling.wait)
        out = plane.alltoall(_payload(item.src), [int(s) for s in splits], [int(r) for r in recv])
        return [(out, recv)]

    def _size(self, batch: list[Item]) -> int:
        return int(self.comm_of(batch[0].resp.sig.ps_id).Get_size())


def _payload(buffer: Any) -> Any:
    return getattr(buffer, "payload", buffer)


def plane_failure(rank: int, plane: str, batch: list[Item], exc: Exception) -> str:
    """The message a plane's failure ends the engine with (the plane is in an unknown state afterwards)."""
    names = ", ".join(sorted({item.resp.name for item in batch}))
    return (f"rank {rank}: the {plane} data plane failed in {batch[0].resp.sig.kind} of {names}: "
            f"{type(exc).__name__}: {exc}. Every pending and later collective raises this error; fix the "
            f"cause and restart the job (HOROVOD_GPU_OPERATIONS / HOROVOD_CPU_OPERATIONS choose the planes)")
