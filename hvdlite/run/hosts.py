"""Host lists for hvdlite-run: parse ``-H host:slots,...`` and hostfiles, check slots, read a Slurm allocation."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..core.launch import int_or_none


class HostSpecError(ValueError):
    """A host list, hostfile or process count that cannot work."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host and how many processes (slots) it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def parse_hosts(spec: str) -> list[Host]:
    """Parse ``"h1:2,h2:2"`` (a host without ``:slots`` has one slot)."""
    hosts: list[Host] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        hosts.append(_host(name, slots, f"-H {spec!r}"))
    if not hosts:
        raise HostSpecError(f"-H {spec!r} names no host; write it as host1:slots,host2:slots")
    return merge(hosts)


_HOSTFILE_LINE = re.compile(r"^(?P<name>[^\s:]+)(?::(?P<colon>\S+)|\s+(?:slots|max_slots)\s*=\s*(?P<kw>\S+))?"
                            r"(?:\s+.*)?$")


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read a hostfile: one host a line as ``host slots=N``, ``host:N`` or ``host``; ``#`` starts a comment."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise HostSpecError(f"cannot read hostfile {str(file)!r}: {exc.strerror}") from None
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise HostSpecError(f"{file}:{number}: cannot read {raw!r}; write 'hostname slots=N'")
        slots = match.group("colon") or match.group("kw") or "1"
        hosts.append(_host(match.group("name"), slots, f"{file}:{number}"))
    if not hosts:
        raise HostSpecError(f"hostfile {str(file)!r} names no host")
    return merge(hosts)


def _host(name: str, slots: str, where: str) -> Host:
    if not name:
        raise HostSpecError(f"{where}: empty host name")
    try:
        count = int(slots)
    except ValueError:
        raise HostSpecError(f"{where}: slots of {name!r} must be a whole number, got {slots!r}") from None
    if count < 1:
        raise HostSpecError(f"{where}: host {name!r} must have at least 1 slot, got {count}")
    return Host(name, count)


def merge(hosts: Sequence[Host]) -> list[Host]:
    """Add up the slots of a host named twice, keeping first-seen order."""
    slots: dict[str, int] = {}
    for host in hosts:
        slots[host.name] = slots.get(host.name, 0) + host.slots
    return [Host(name, count) for name, count in slots.items()]


def total_slots(hosts: Sequence[Host]) -> int:
    return sum(host.slots for host in hosts)


def check_slots(num_proc: int, hosts: Sequence[Host]) -> None:
    """Refuse a process count larger than the hosts' slots."""
    available = total_slots(hosts)
    if num_proc > available:
        listing = ",".join(str(h) for h in hosts)
        raise HostSpecError(f"asked for {num_proc} processes (-np {num_proc}) but the hosts give only "
                            f"{available} slots ({listing}); add hosts or slots (host:slots), or lower -np")


def hosts_by_rank(hosts: Sequence[Host], num_proc: int) -> list[str]:
    """Host of each rank when ranks fill hosts in order (rank 0..slots-1 on the first host, ...)."""
    return [host.name for host in hosts for _ in range(host.slots)][:num_proc]


@dataclasses.dataclass(frozen=True)
class SlurmAllocation:
    """What the Slurm job we run inside gives us."""

    job_id: str
    tasks: int


def slurm_allocation(env: Mapping[str, str]) -> Optional[SlurmAllocation]:
    """The enclosing Slurm allocation (sbatch/salloc), or None outside Slurm."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    tasks = int_or_none(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS"))
    if tasks is None:
        tasks = cpus_per_node_total(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    return SlurmAllocation(job_id=job_id, tasks=tasks or 0)


def cpus_per_node_total(spec: str) -> int:
    """Total of Slurm's ``SLURM_JOB_CPUS_PER_NODE`` such as ``"4(x2),2"`` (= 10)."""
    total = 0
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return 0
        total += int(match.group(1)) * int(match.group(2) or 1)
    return total
