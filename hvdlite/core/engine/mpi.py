"""The one module that imports mpi4py: start-up and thread level, datatypes and ops, communicator helpers."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import LaunchError
from ..reduce_ops import (HALF_DTYPES, NUMPY_REDUCTION, Average, ReduceOp, Sum, Min, Max, Product, bf16_to_f32,
                          f32_to_bf16)

_MPI: Any = None

THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED", "MPI_THREAD_MULTIPLE")


def start(before_init: Optional[Callable[[str], None]] = None) -> Any:
    """Initialise MPI (asking for MPI_THREAD_MULTIPLE) and check the level granted; return the module.
    ``before_init(library_text)``, when given, looks at the library before MPI_Init (and may raise)."""
    global _MPI
    if _MPI is None:
        import sys
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
        looking = "mpi4py.MPI" not in sys.modules and before_init is not None
        if looking:
            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True  # as if mpi4py had started MPI itself
        from mpi4py import MPI
        if before_init is not None and looking:
            before_init(MPI.Get_library_version())
        if not MPI.Is_initialized():  # (also: loaded without starting MPI by probe_library, in this process)
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
            if not looking:
                atexit.register(finalize)
        _MPI = MPI
    level = _MPI.Query_thread()
    if level < _MPI.THREAD_SERIALIZED:
        raise LaunchError(
            f"the MPI library mpi4py loaded ({library_version()}) granted only {THREAD_LEVELS[level]}; "
            f"hvdlite's engine thread needs at least MPI_THREAD_SERIALIZED. Use an MPI built with thread "
            f"support (pip install mpich, or Open MPI built with --enable-mpi-thread-multiple).")
    return _MPI


def started() -> bool:
    """Whether MPI is up in this process (started by hvdlite or anyone else), without starting it."""
    import sys
    loaded = sys.modules.get("mpi4py.MPI")
    return loaded is not None and bool(loaded.Is_initialized())


def library_version() -> str:
    return _MPI.Get_library_version().strip().splitlines()[0] if _MPI is not None else "unknown"


def probe_library() -> Optional[tuple[str, tuple[int, int]]]:
    """The MPI library's version text and (major, minor) standard, without starting MPI; None where none loads."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        return MPI.Get_library_version().strip(), MPI.Get_version()
    except Exception:  # noqa: BLE001 - any failure to load means "no usable MPI here"
        return None


def thread_multiple() -> bool:
    return bool(_MPI.Query_thread() >= _MPI.THREAD_MULTIPLE)


# -- communicators -------------------------------------------------------------------------------------
def world_size() -> int:
    return int(_MPI.COMM_WORLD.Get_size())


def make_world(comm: Any) -> Any:
    """The communicator hvdlite runs on: a dup of COMM_WORLD, of a given communicator, or of the listed ranks."""
    MPI = _MPI
    if comm is None:
        return MPI.COMM_WORLD.Dup()
    if isinstance(comm, MPI.Comm):
        return comm.Dup()
    ranks = sorted({int(r) for r in comm})
    me = MPI.COMM_WORLD.Get_rank()
    sub = MPI.COMM_WORLD.Split(0 if me in ranks else MPI.UNDEFINED, key=me)
    if sub == MPI.COMM_NULL:
        raise LaunchError(f"rank {me} of MPI_COMM_WORLD is not in init(comm={ranks}); only the listed ranks "
                          f"may call init() with it")
    return sub


def communicator_world_ranks(comm: Any, world: Any) -> Optional[list[int]]:
    """The ranks of ``world`` that make up the mpi4py communicator ``comm`` (None where this rank is no member)."""
    if comm == _MPI.COMM_NULL:
        return None
    ranks = _translate(comm.Get_group(), world)
    if _MPI.UNDEFINED in ranks:
        raise ValueError("ProcessSet(comm): the communicator holds processes outside hvdlite's world "
                         "(init(comm=...)); build it from that world")
    return sorted(ranks)


def _translate(group: Any, comm: Any) -> list[int]:
    """The rank in ``comm`` of each member of ``group`` (MPI.UNDEFINED for one outside it); frees ``group``."""
    other = comm.Get_group()
    try:
        return [int(r) for r in _MPI.Group.Translate_ranks(group, list(range(group.Get_size())), other)]
    finally:
        group.Free()
        other.Free()


def split_shared(comm: Any, key: int) -> Any:
    """The ranks of ``comm`` that share this node's memory."""
    return comm.Split_type(_MPI.COMM_TYPE_SHARED, key=key)


def split_member(comm: Any, member: bool, key: int) -> Optional[Any]:
    """A communicator of the ranks that pass ``member=True`` (collective over ``comm``); None elsewhere."""
    sub = comm.Split(0 if member else _MPI.UNDEFINED, key=key)
    return None if sub == _MPI.COMM_NULL else sub


def abort(code: int = 1) -> None:
    _MPI.COMM_WORLD.Abort(code)


def finalize() -> None:
    """End MPI now where it is up, through ctypes, which lets other Python threads run meanwhile (mpi4py's
    Finalize holds the GIL); mpi4py's own exit hook then does nothing."""
    if _MPI is None or not _MPI.Is_initialized() or _MPI.Is_finalized():
        return
    (_mpi_symbol("MPI_Finalize") or _MPI.Finalize)()  # (ctypes' default result type, int, is MPI's)


# -- datatypes and ops ---------------------------------------------------------------------------------
def _datatypes() -> dict[str, Any]:
    """The MPI datatype of each dtype name (float16 and bfloat16 travel as their uint16 bits)."""
    MPI = _MPI
    return {"uint8": MPI.UINT8_T, "int8": MPI.INT8_T, "uint16": MPI.UINT16_T, "int16": MPI.INT16_T,
            "uint32": MPI.UINT32_T, "int32": MPI.INT32_T, "uint64": MPI.UINT64_T, "int64": MPI.INT64_T,
            "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "bool": MPI.C_BOOL, "float16": MPI.UINT16_T,
            "bfloat16": MPI.UINT16_T}


class MPIOps:
    """MPI datatypes and ops for each dtype, created once per process after MPI is up."""

    def __init__(self) -> None:
        MPI = _MPI
        self.MPI = MPI
        self.BYTE = MPI.BYTE
        self.IN_PLACE = MPI.IN_PLACE
        self.BOR = MPI.BOR
        self.tree = "Open MPI" in MPI.Get_library_version()  # short vectors: chunks.start_allreduce
        self.datatypes = _datatypes()
        self._builtin = {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
        self._bool = {Sum: MPI.LOR, Max: MPI.LOR, Min: MPI.LAND, Product: MPI.LAND}
        self._half: dict[tuple[str, ReduceOp], Any] = {}
        self._user: dict[tuple[Callable[[Any, Any, Any], None], int], tuple[Any, Any]] = {}
        for half in HALF_DTYPES:
            for op in (Sum, Min, Max, Product):
                self._half[(half, op)] = MPI.Op.Create(_half_op(half, NUMPY_REDUCTION[op]), commute=True)

    def op(self, dtype: str, op: ReduceOp) -> Any:
        """The MPI.Op for ``op`` on ``dtype`` (the submit checks have refused combinations without one)."""
        if dtype == "bool":
            return self._bool[op]
        if dtype in HALF_DTYPES:
            return self._half[(dtype, Sum if op is Average else op)]
        return self._builtin[op]

    def record_op(self, function: Callable[[Any, Any, Any], None], doubles: int) -> tuple[Any, Any]:
        """The commutative MPI op of ``function`` and the datatype of its record (``doubles`` float64s), made once
        and freed at shutdown (mpi4py holds few user-defined ops at a time)."""
        key = (function, doubles)
        if key not in self._user:
            self._user[key] = (self.MPI.Op.Create(function, commute=True),
                               self.MPI.DOUBLE.Create_contiguous(doubles).Commit())
        return self._user[key]

    def free(self) -> None:
        for op in self._half.values():
            op.Free()
        for op, datatype in self._user.values():
            op.Free()
            datatype.Free()
        self._half.clear()
        self._user.clear()


def _half_op(kind: str, ufunc: Callable[..., Any]) -> Callable[[Any, Any, Any], None]:
    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a, b = np.frombuffer(inbuf, dtype=np.uint16), np.frombuffer(inoutbuf, dtype=np.uint16)
        if kind == "float16":
            ufunc(a.view(np.float16), b.view(np.float16), out=b.view(np.float16))
        else:
            b[...] = f32_to_bf16(ufunc(bf16_to_f32(a), bf16_to_f32(b)))
    return reduce


def counts_displacements(counts: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, displacements) arrays for the v-variants of MPI collectives."""
    counts = np.asarray(counts, dtype=np.int64)
    return counts, np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


# -- device buffers (CUDA-aware MPI) -------------------------------------------------------------------
def cuda_aware(override: str = "auto") -> tuple[bool, str]:
    """Whether the loaded MPI library takes CUDA device buffers, and how that was found (after MPI is up):
    ``override`` "on"/"off", else MPI 4.1's ``mpi_memory_alloc_kinds``, else ``MPIX_Query_cuda_support()``."""
    library = " ".join(library_version().split())
    if override in ("on", "off"):
        return override == "on", f"{library}; HVDLITE_MPI_CUDA_AWARE={override} says so"
    info = _MPI.COMM_WORLD.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()
    if "cuda" in kinds.lower():
        return True, f"{library}: mpi_memory_alloc_kinds lists {kinds!r}"
    query = _mpi_symbol("MPIX_Query_cuda_support")
    if query is None:
        return False, (f"{library}: mpi_memory_alloc_kinds is {kinds!r} (no cuda kind) and the library has no "
                       f"MPIX_Query_cuda_support(); set HVDLITE_MPI_CUDA_AWARE=on if it is CUDA-aware")
    answer = int(query())  # int MPIX_Query_cuda_support(void): ctypes' defaults
    return answer == 1, f"{library}: MPIX_Query_cuda_support() returned {answer}"


def _mpi_symbol(name: str) -> Any:
    """A C function of the MPI library this process loaded (None where no loaded libmpi exports it)."""
    paths: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:  # (not Linux: the symbols seen globally)
        paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
    candidates: list[Optional[str]] = list(paths) if paths else [None]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        if hasattr(lib, name):
            return getattr(lib, name)
    return None


class BufferComm:
    """MPI collectives on a plane's own buffers as they are, on a duplicate of the set's communicator; they block (Open
    MPI takes device buffers only in blocking collectives). The caller makes the bytes ready (its streams done)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self._types = _datatypes()
        self._ops = {"sum": _MPI.SUM, "min": _MPI.MIN, "max": _MPI.MAX, "product": _MPI.PROD}

    def allreduce(self, buf: Any, dtype: str, op: str) -> None:
        """In place; ``dtype`` a fixed-size numeric name, ``op`` sum/min/max/product."""
        self.comm.Allreduce(_MPI.IN_PLACE, [buf, self._types[dtype]], op=self._ops[op])

    def allgather(self, send: Any, recv: Any) -> None:
        """Equal blocks of bytes from every member, in rank order."""
        self.comm.Allgather([send, _MPI.BYTE], [recv, _MPI.BYTE])

    def bcast(self, buf: Any, root: int) -> None:
        self.comm.Bcast([buf, _MPI.BYTE], root=root)

    def alltoallv(self, send: Any, send_bytes: Sequence[int], recv: Any, recv_bytes: Sequence[int]) -> None:
        self.comm.Alltoallv([send, counts_displacements(send_bytes), _MPI.BYTE],
                            [recv, counts_displacements(recv_bytes), _MPI.BYTE])

    def free(self) -> None:
        self.comm.Free()


# -- fault tolerance (ULFM: MPIX_Comm_revoke/shrink/agree) -----------------------------------------------
def ulfm_library() -> tuple[bool, str]:
    """Whether the loaded MPI library can recover in-process (ULFM, and Open MPI 5), and why; MPI need not be up."""
    if _MPI is not None:
        library = library_version()
    else:
        probe = probe_library()
        library = " ".join(probe[0].splitlines()[0].split()) if probe else "no MPI library (mpi4py loads none)"
    library = library.split(",")[0]  # "Open MPI v5.0.11" (the rest of Open MPI's line is its packaging)
    if _mpi_symbol("MPIX_Comm_shrink") is None:
        return False, f"{library} has no ULFM (MPIX_Comm_shrink)"
    if not library.startswith("Open MPI"):
        return False, (f"{library} exports ULFM's MPIX_Comm_shrink, but hvdlite recovers in-process only with "
                       f"Open MPI 5 (MPICH 5 fails in MPI_Init with MPIR_CVAR_ENABLE_FT=1)")
    return True, f"{library} has ULFM"


def fault_tolerance(launcher_enabled: bool) -> tuple[bool, str]:
    """Whether this job can survive a lost rank in the same processes, and why: a library with ULFM and a launch
    that turned it on (``launcher_enabled``: ``mpiexec --with-ft ulfm`` sets OMPI_MCA_mpi_ft_enable=1)."""
    usable, why = ulfm_library()
    if not usable:
        return False, why
    if not launcher_enabled:
        return False, f"{why}, but the job was not started with it (mpiexec --with-ft ulfm)"
    return True, f"{why}, turned on (mpiexec --with-ft ulfm)"


def errors_return(comm: Any) -> None:
    """Make MPI errors on ``comm`` come back as exceptions (a lost peer must not abort the survivors)."""
    comm.Set_errhandler(_MPI.ERRORS_RETURN)


def is_process_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's report of a lost peer: MPI_ERR_PROC_FAILED(_PENDING) or MPI_ERR_REVOKED."""
    if _MPI is None or not isinstance(exc, _MPI.Exception):
        return False
    return exc.Get_error_class() in (_MPI.ERR_PROC_FAILED, _MPI.ERR_PROC_FAILED_PENDING, _MPI.ERR_REVOKED)


def revoke(comm: Any) -> None:
    """Revoke ``comm`` so every member's pending and later calls on it fail at once (none waits for a dead peer)."""
    with contextlib.suppress(_MPI.Exception, NotImplementedError, AttributeError):
        comm.Revoke()


def progress() -> None:
    """One turn of MPI's progress engine: news of a dead peer arrives only inside MPI calls (docs/elastic.md)."""
    with contextlib.suppress(_MPI.Exception):  # only a turn of progress is wanted; the caller asks Get_failed next
        _MPI.COMM_SELF.Iprobe(_MPI.ANY_SOURCE, _MPI.ANY_TAG)


def failed_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm`` this process knows to have failed (local, no communication)."""
    try:
        group = comm.Get_failed()
    except (_MPI.Exception, NotImplementedError, AttributeError):
        return []
    return sorted(_translate(group, comm))


def agree(comm: Any) -> bool:
    """Whether no member of ``comm`` was lost (MPIX_Comm_agree: the same answer on every live member, also on a
    revoked ``comm``)."""
    try:
        comm.Agree(1)
    except _MPI.Exception as exc:
        if not is_process_failure(exc):
            raise
        return False
    return True


def shrink(comm: Any, agreed: bool = False) -> tuple[Any, list[int]]:
    """The survivors of ``comm`` (revoked first, then the agreement that a rank finishing its run joins, unless this
    one did: ``agreed``): a new communicator of the live ranks, agreed by all of them (Shrink, then Agree, again
    while ranks keep failing), and which ranks of ``comm`` each new rank was."""
    revoke(comm)
    if not agreed:
        agree(comm)
    current = comm
    while True:
        survivors = current.Shrink()
        errors_return(survivors)
        if agree(survivors):  # not where a member died since the shrink: shrink again
            break
        revoke(survivors)
        current = survivors
    return survivors, _translate(survivors.Get_group(), comm)
