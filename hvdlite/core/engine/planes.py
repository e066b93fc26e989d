"""Data planes: the interface a frontend implements to move an agreed batch's bytes off MPI's host path."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from . import deterministic, polling
from .mpi import BufferComm

from ..reduce_ops import Accumulation, ReduceOp


class PlaneBuffer:
    """One framework tensor handed to the core for a data plane; the core only reads its metadata."""

    __slots__ = ("plane", "payload", "dtype_name", "shape", "ready")

    def __init__(self, plane: str, payload: Any, dtype_name: str, shape: tuple[Any, ...], ready: Any = None) -> None:
        self.plane = plane
        self.payload = payload          # the framework tensor (contiguous), owned by the plane's frontend
        self.dtype_name = dtype_name    # a core dtype name ("float32", "bfloat16", ...)
        self.shape = tuple(shape)
        self.ready = ready              # what the plane waits for before reading (e.g. a CUDA event)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def reshape(self, *shape: Any) -> "PlaneBuffer":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        return PlaneBuffer(self.plane, self.payload.reshape(shape), self.dtype_name, shape, self.ready)


class DataPlane:
    """Moves the bytes of agreed batches among one process set's members (engine thread only): each method gets the
    batch's payloads (framework tensors, in batch order) and returns the results; ``outputs[i]`` is where result i
    goes (None: a new tensor). Ops, factors, root, rows and splits are agreed; Average's divisor is in ``post``."""

    name = ""

    def allreduce(self, inputs: list[Any], outputs: list[Any], dtype: str, op: ReduceOp, pre: float,
                  post: float) -> list[Any]:
        raise NotImplementedError

    def allreduce_accumulated(self, inputs: list[Any], outputs: list[Any], dtype: str, acc: Accumulation,
                              pre: float, post: float) -> list[Any]:
        """Sum with an accumulating compression: engine/deterministic.py's rule over the plane's own moves."""
        raise NotImplementedError(f"the {self.name} data plane has no float32-accumulating allreduce; use "
                                  f"Compression.bf16, or reduce these tensors over MPI")

    def allgather(self, inputs: list[Any], rows: list[list[int]]) -> list[Any]:
        """``rows[r][i]``: rows rank r contributes to tensor i; results are the concatenations."""
        raise NotImplementedError

    def broadcast(self, inputs: list[Any], outputs: list[Any], root: int) -> list[Any]:
        raise NotImplementedError

    def alltoall(self, tensor: Any, send_splits: list[int], recv_splits: list[int]) -> Any:
        raise NotImplementedError

    def reducescatter(self, inputs: list[Any], dtype: str, op: ReduceOp, pre: float, post: float,
                      splits: list[list[int]]) -> list[Any]:
        """``splits[i][r]``: rows of tensor i that rank r keeps."""
        raise NotImplementedError

    def wait_ready(self, events: list[Any]) -> None:
        """Order the batch after the work that produced its inputs (``PlaneBuffer.ready`` of each)."""

    def zeros(self, dtype: str, shape: tuple[Any, ...]) -> Any:
        """A stand-in tensor for a rank that joined (zeros, or no rows)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the plane (every member calls it at the same point: shutdown or set removal)."""

    def abandon(self) -> None:
        """After a failure (a peer gone or stuck inside this plane's collective): release, without the peers,
        what would otherwise stay stuck (nothing by default). The plane is kept until the process exits."""


class Bootstrap:
    """What a factory gets to set a plane up among one process set's members, over hvdlite's MPI."""

    def __init__(self, ps_id: int, rank: int, size: int, comm: Any, world_rank: int, local: bool,
                 deterministic: bool = False) -> None:
        self.ps_id = ps_id
        self.rank = rank
        self.size = size
        self.world_rank = world_rank
        self.single_host = local  # every member runs on this node
        self.deterministic = deterministic  # the job's agreed setting: see in_rank_order()
        self._comm = comm

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self._comm.bcast(value, root=root)

    def allgather(self, value: Any) -> list[Any]:
        return list(self._comm.allgather(value))

    def buffers(self) -> BufferComm:
        """MPI collectives on the plane's own buffers (collective: every member calls it while making the plane)."""
        return BufferComm(self._comm)

    @staticmethod
    def wait(test: Callable[[], bool]) -> None:
        """Wait until ``test()`` is true as the engine waits for MPI (the stall watch runs between polls)."""
        polling.wait(polling.Polled(test))


def in_rank_order(boot: Bootstrap, dtype: str, op: ReduceOp) -> bool:
    """Whether a plane must reduce ``dtype`` with ``op`` by rank_order_allreduce() (deterministic=True)."""
    return boot.deterministic and deterministic.applies(dtype, op)


def rank_order_allreduce(plane: DataPlane, boot: Bootstrap, flat: Any, op: ReduceOp) -> None:
    """deterministic=True on a plane: engine/deterministic.py's rule over the plane's moves, ``flat`` (1-D) in place."""
    if int(flat.shape[0]):
        flat[...] = deterministic.plane_slices(plane, boot.rank, boot.size, flat,
                                               lambda parts: deterministic.rank_order(parts, op))


def accumulated_allreduce(plane: DataPlane, boot: Bootstrap, flat32: Any, acc: Accumulation, post: float,
                          cast: Callable[[Any, str], Any]) -> Any:
    """An accumulating compression on a plane: engine/deterministic.py's rule over the plane's moves, of ``flat32``
    (1-D float32, prescaled); returns the all-gathered result in ``acc.gather``. ``cast``: the framework's cast."""
    def reduce(parts: list[Any]) -> Any:
        total = cast(parts[0], "float32")
        for part in parts[1:]:  # rank order, in float32
            total += cast(part, "float32")
        if post != 1.0:  # float32(double(x) * factor), as scale_inplace on the MPI path: the same bits
            total = cast(cast(total, "float64") * float(post), "float32")
        return total if acc.gather == "float32" else cast(total, acc.wire)
    return deterministic.plane_slices(plane, boot.rank, boot.size, cast(flat32, acc.wire), reduce)


class PlaneFactory:
    """What a frontend registers: which planes it can make here, and making one for a process set."""

    def available(self, settings: Any) -> list[str]:
        """Plane names this process can run (the job uses those every rank can run)."""
        raise NotImplementedError

    def built(self, what: str) -> bool:
        """Whether this frontend's libraries here support ``what`` ("nccl", "gloo", "cuda"), at run time."""
        return False

    def make(self, name: str, boot: Bootstrap) -> DataPlane:
        raise NotImplementedError

    def closing(self, boot: Bootstrap) -> None:
        """Called once per job at shutdown, after every plane closed (e.g. to stop a rendezvous store)."""

    def forget(self) -> None:
        """Called instead of closing() after a failure: drop this job's set-up without waiting for peers."""


_factories: list[PlaneFactory] = []
_ABANDONED: list[DataPlane] = []  # planes of a failed job, kept (not destroyed) until the process exits


def register_factory(factory: PlaneFactory) -> None:
    """Register a frontend's plane factory (before hvd.init(): planes are made when sets are made)."""
    if factory not in _factories:
        _factories.append(factory)


def built(what: str) -> bool:
    """Whether any registered frontend can run ``what`` here (the build flags nccl_built() and kin)."""
    return any(f.built(what) for f in _factories)


class PlaneTable:
    """The planes of this job: names agreed at init(), one plane per (name, process set)."""

    def __init__(self, settings: Any, world: Any, world_rank: int, single_host: bool) -> None:
        self.world_rank = world_rank
        self.single_host = single_host
        self.deterministic = bool(settings.deterministic)
        mine = {name: f for f in _factories for name in f.available(settings)}
        everyone = world.allgather(sorted(mine))
        self.agreed = sorted(set.intersection(*[set(names) for names in everyone]))  # agreement rule
        self._offered: list[list[str]] = everyone
        self._factory: dict[str, PlaneFactory] = {name: mine[name] for name in self.agreed}
        self._planes: dict[tuple[str, int], DataPlane] = {}
        self._world = world

    def make_for_set(self, ps_id: int, comm: Any) -> None:
        """Make every agreed plane for a new set (members only; all in the same order)."""
        if comm is None or not self.agreed:
            return
        boot = Bootstrap(ps_id, comm.Get_rank(), comm.Get_size(), comm, self.world_rank, self.single_host,
                         self.deterministic)
        for name in self.agreed:
            self._planes[(name, ps_id)] = self._factory[name].make(name, boot)

    def set_changed(self, added: bool, ps_id: int, comm: Any) -> None:
        """A process set was added (make its planes) or removed (close them): agreed, on the engine thread."""
        if added:
            return self.make_for_set(ps_id, comm)
        for key in [k for k in self._planes if k[1] == ps_id]:
            self._planes.pop(key).close()

    def plane(self, name: str, ps_id: int) -> DataPlane:
        plane = self._planes.get((name, ps_id))
        if plane is None:
            raise RuntimeError(f"no data plane {name!r} for process set {ps_id} on rank {self.world_rank}; "
                               f"import the frontend (e.g. hvdlite.torch) before hvd.init()")
        return plane

    def has(self, name: str) -> bool:
        return name in self.agreed

    def lacking(self, name: str) -> list[int]:
        """The ranks that cannot run plane ``name`` (why the job runs without it; [] where it is agreed)."""
        return [rank for rank, names in enumerate(self._offered) if name not in names]

    def close(self, clean: bool = True) -> None:
        """Close every plane, then let the factories end the job's rendezvous together; after a failure (not
        ``clean``) closing could block forever: each plane only ``abandon()``s what it can release alone."""
        if not clean:
            for plane in self._planes.values():
                plane.abandon()
            _ABANDONED.extend(self._planes.values())
            self._planes.clear()
            for factory in {id(f): f for f in self._factory.values()}.values():
                factory.forget()
            return
        for key in sorted(self._planes, key=lambda k: -k[1]):
            self._planes.pop(key).close()
        if self.agreed:
            boot = Bootstrap(0, self._world.Get_rank(), self._world.Get_size(), self._world, self.world_rank,
                             self.single_host)
            for factory in {id(f): f for f in self._factory.values()}.values():
                factory.closing(boot)


def plane_of(inputs: Sequence[Any], kind: Any, name: str) -> str:
    """The data plane the buffers of request ``kind`` ``name`` name (all the same, or a clear error; "" for none)."""
    names = {getattr(a, "plane", "") for a in inputs}
    if len(names) > 1:
        raise TypeError(f"{kind} {name!r}: the tensors of one grouped op must all be on one kind of device "
                        f"(host memory or the rank's GPU); got tensors for data planes "
                        f"{sorted(n or 'mpi' for n in names)}. "
                        f"Move them to one device first, or submit them as separate ops")
    return names.pop() if names else ""
