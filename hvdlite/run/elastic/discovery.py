"""Where an elastic job may run now: discovered hosts (script, -H list, Slurm nodes) minus blacklisted ones."""
from __future__ import annotations

import argparse
import logging
import random
import subprocess
import time
from typing import Callable, Mapping, Optional, Sequence

from ..hosts import (Host, HostSpecError, _host, hosts_by_rank, merge, parse_hostfile, parse_hosts, slurm_allocation,
                     total_slots)


class DiscoveryError(RuntimeError):
    """The host discovery script failed or printed something that is not ``host[:slots]`` lines."""


def run_discovery_script(script: str, slots_per_host: Optional[int], env: Mapping[str, str],
                         timeout: float = 60) -> list[Host]:
    """Run the script (as horovodrun does, through the shell) and read one ``host[:slots]`` a line."""
    try:
        proc = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout, env=dict(env),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"host discovery script {script!r} ran longer than {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise DiscoveryError(f"host discovery script {script!r} exited {proc.returncode}: "
                             f"{proc.stderr.strip()[-500:]}")
    return parse_discovered(proc.stdout, slots_per_host, script)


def parse_discovered(text: str, slots_per_host: Optional[int], where: str) -> list[Host]:
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots = line.rpartition(":")
        if not sep:
            name, slots = line, str(slots_per_host or 1)
        elif slots_per_host is not None:
            slots = str(slots_per_host)  # --slots-per-host overrides, as in horovodrun
        try:
            hosts.append(_host(name, slots, where))
        except HostSpecError:
            raise DiscoveryError(f"{where}, line {number}: {raw!r} is not host:slots with slots >= 1") from None
    return merge(hosts)


def slurm_nodes(env: Mapping[str, str]) -> list[str]:
    """The allocation's node names (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        raise HostSpecError("inside Slurm but SLURM_JOB_NODELIST is not set")
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=60, env=dict(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostSpecError(f"cannot expand the Slurm node list {nodelist!r}: {exc}") from None
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        raise HostSpecError(f"scontrol show hostnames {nodelist!r} failed: {proc.stderr.strip()}")
    return names


#: A host is blacklisted when this many of its ranks were lost within FAILURE_WINDOW_S: one lost rank is a process
#: that died (killed, out of memory, preempted), not a lost host; its slot is used again at the next start.
REPEATED_FAILURES = 3
FAILURE_WINDOW_S = 60.0


class Blacklist:
    """Hosts excluded from the next starts: one that fails repeatedly (REPEATED_FAILURES lost ranks within
    FAILURE_WINDOW_S), for a random time in --blacklist-cooldown-range, or for good without one."""

    def __init__(self, cooldown: Optional[Sequence[float]] = None) -> None:
        self.cooldown = tuple(cooldown) if cooldown else None
        self._until: list[tuple[str, float]] = []
        self.failures: dict[str, list[float]] = {}  # the hosts that lost a rank (the times)

    def failed(self, host: str) -> tuple[int, Optional[float]]:
        """One rank of ``host`` was lost: (its host's lost ranks within FAILURE_WINDOW_S, the seconds ``host`` is
        now excluded for: None when it is not, inf for good)."""
        now = time.monotonic()
        recent = [t for t in self.failures.get(host, []) if now - t < FAILURE_WINDOW_S] + [now]
        self.failures[host] = recent
        if len(recent) < REPEATED_FAILURES:
            return len(recent), None
        self.failures[host] = []
        return len(recent), self.add(host)

    def add(self, host: str) -> float:
        """Exclude ``host``; return for how many seconds (inf: for good)."""
        seconds = random.uniform(*self.cooldown) if self.cooldown else float("inf")
        self._until.append((host, time.monotonic() + seconds))
        return seconds

    def for_good(self) -> list[str]:
        """The hosts excluded for good (failing repeatedly without a cooldown range)."""
        return sorted({h for h, t in self._until if t == float("inf")})

    def apply(self, hosts: Sequence[Host]) -> list[Host]:
        now = time.monotonic()
        self._until = [(h, t) for h, t in self._until if t > now]
        return [h for h in hosts if h.name not in {name for name, _ in self._until}]


def describe_failure(host: str, failures: int, seconds: Optional[float]) -> str:
    """What a lost rank did to its host's standing (Blacklist.failed's answer), for the driver's log."""
    if seconds is None:
        return (f"a process that died, not a lost host: its slot is used again ({failures} lost rank(s) of {host} "
                f"within {FAILURE_WINDOW_S:.0f} s; {REPEATED_FAILURES} blacklist it)")
    span = "for good (no --blacklist-cooldown-range)" if seconds == float("inf") else f"for {seconds:.0f} s"
    return f"host {host} blacklisted {span}: {failures} of its ranks lost within {FAILURE_WINDOW_S:.0f} s"


def wait_for_slots(usable: Callable[[], list[Host]], min_np: int, timeout_s: float, interval_s: float,
                   stopped: Callable[[], bool], log: logging.Logger,
                   hopeless: Callable[[], str] = lambda: "") -> Optional[list[Host]]:
    """``usable()`` once it has at least ``min_np`` slots, asking every ``interval_s`` for up to ``timeout_s``;
    None past that, as soon as ``stopped()``, or once ``hopeless()`` says why no slot that is missing can come back."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            hosts = usable()
        except DiscoveryError as exc:
            log.warning("%s", exc)
            hosts = []
        if total_slots(hosts) >= min_np:
            return hosts
        if hopeless():
            return None
        if not said:
            log.info("waiting up to %.0f s for %d slots (--min-np); usable now: %s", timeout_s, min_np,
                     ",".join(map(str, hosts)) or "none")
            said = True
        if time.monotonic() > deadline or stopped():
            return None
        time.sleep(interval_s)


def assign(hosts: Sequence[Host], num_proc: int) -> list[Host]:
    """The first ``num_proc`` slots, host by host (what the job runs on)."""
    return merge([Host(name, 1) for name in hosts_by_rank(hosts, num_proc)])


class HostSource:
    """Where hosts come from: the discovery script, -H/--hostfile, the Slurm allocation, or this machine."""

    def __init__(self, args: argparse.Namespace, env: Mapping[str, str], max_np: int) -> None:
        self.env = env
        self.script = args.host_discovery_script
        self.slots_per_host = args.slots_per_host
        self.fixed: Optional[list[Host]] = None
        self.slurm = False
        if self.script:
            self.kind = f"discovery script {self.script}"
        elif args.hosts or args.hostfile:
            self.fixed = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
            self.kind = "hosts " + ",".join(map(str, self.fixed))
        elif (allocation := slurm_allocation(env)) is not None:
            names = slurm_nodes(env)
            per_node = self.slots_per_host or max(1, (allocation.tasks or len(names)) // len(names))
            self.fixed = [Host(name, per_node) for name in names]
            self.slurm = True
            self.kind = f"Slurm job {allocation.job_id} nodes " + ",".join(map(str, self.fixed))
        else:
            self.fixed = [Host("localhost", self.slots_per_host or max_np)]
            self.kind = f"this machine ({self.fixed[0].slots} slots)"

    def discover(self) -> list[Host]:
        if self.script:
            return run_discovery_script(self.script, self.slots_per_host, self.env)
        return list(self.fixed or [])


def hopeless(fixed: Optional[Sequence[Host]], for_good: Sequence[str], min_np: int) -> str:
    """Why fewer than ``min_np`` slots can ever be usable again ("" while some may come back): the hosts are
    ``fixed`` (no discovery script) and those left after the ones blacklisted ``for_good`` are too few."""
    left = total_slots([h for h in fixed or () if h.name not in for_good])
    if fixed is None or not for_good or left >= min_np:
        return ""
    return (f"host(s) {','.join(for_good)} blacklisted for good (their ranks failed repeatedly, and no "
            f"--blacklist-cooldown-range lets them back); the other fixed hosts have {left} slot(s), fewer than "
            f"--min-np {min_np}, and no discovery script can add any")
