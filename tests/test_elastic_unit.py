"""ElasticShards (the core of ElasticSampler), the elastic flag parsing, and how the driver deletes a host's
commits, without MPI."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.core import runtime
from hvdlite.core.elastic import ElasticShards
from hvdlite.core.launch import remover_command
from hvdlite.run.args import is_elastic, parse_args
from hvdlite.run.elastic.cleanup import CommitRemover, remove_leftover_shm, shm_files
from hvdlite.run.elastic.discovery import (REPEATED_FAILURES, Blacklist, DiscoveryError, describe_failure, hopeless,
                                          parse_discovered)
from hvdlite.run.elastic.driver import ElasticDriver
from hvdlite.run.elastic.server import DriverServer
from hvdlite.run.hosts import Host


def shards_at(monkeypatch: pytest.MonkeyPatch, size: int, state: dict, n: int = 60) -> list[ElasticShards]:
    out = []
    for r in range(size):
        monkeypatch.setattr(runtime, "size", lambda: size)
        monkeypatch.setattr(runtime, "rank", lambda r=r: r)
        shards = ElasticShards(n, shuffle=True, seed=3)
        if state:
            shards.load_state_dict(state)
        out.append(shards)
    return out


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3), (4, 3)])
def test_resumed_epoch_repeats_and_skips_nothing(monkeypatch: pytest.MonkeyPatch, before: int, after: int) -> None:
    batch = 4
    first = shards_at(monkeypatch, before, {})
    done: list[int] = []
    for b in range(2):  # two batches on every rank, then a commit
        for s in first:
            s.record_batch(b, batch)
        for s in first:
            done += s.indices[b * batch:(b + 1) * batch]
    committed = first[0].state_dict()
    assert all(s.state_dict() == committed for s in first)  # the same record on every rank
    second = shards_at(monkeypatch, after, committed)
    rest = [i for s in second for i in s.indices]
    assert sorted(set(done + rest)) == list(range(60))  # nothing skipped
    pad = -(60 - len(done)) % after  # nothing repeated but the padding that evens out the last shard
    assert len(done + rest) == 60 + pad and len(set(done)) == len(done)
    assert len({len(s) for s in second}) == 1  # same number of batches on every rank


def test_set_epoch_keeps_the_epoch_in_progress_and_clears_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    (shards,) = shards_at(monkeypatch, 1, {})
    shards.record_batch(0, 10)
    shards.set_epoch(0)
    assert len(shards) == 50
    order0 = list(shards.indices)
    shards.set_epoch(1)
    assert len(shards) == 60 and shards.indices != order0


def test_padding_when_the_rest_does_not_divide(monkeypatch: pytest.MonkeyPatch) -> None:
    shards = shards_at(monkeypatch, 4, {}, n=10)
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    assert sorted(set(i for s in shards for i in s.indices)) == list(range(10))


def test_elastic_flags() -> None:
    args = parse_args(["-np", "3", "--min-np", "2", "--max-np", "4", "--host-discovery-script", "./d.sh",
                       "--slots-per-host", "2", "--elastic-timeout", "30", "--reset-limit", "1",
                       "--blacklist-cooldown-range", "5", "10", "python", "t.py"])
    assert is_elastic(args)
    assert (args.min_np, args.max_np, args.host_discovery_script, args.slots_per_host, args.elastic_timeout,
            args.reset_limit, args.blacklist_cooldown_range) == (2, 4, "./d.sh", 2, 30.0, 1, [5.0, 10.0])
    assert not is_elastic(parse_args(["-np", "2", "python", "t.py"]))


def test_discovery_output_and_blacklist() -> None:
    assert parse_discovered("h1:2\n# comment\nh2\nh1:1\n", None, "s") == [Host("h1", 3), Host("h2", 1)]
    assert parse_discovered("h1:2\nh2\n", 4, "s") == [Host("h1", 4), Host("h2", 4)]
    with pytest.raises(DiscoveryError, match=r"s, line 1: 'h1:x' is not host:slots"):
        parse_discovered("h1:x\n", None, "s")
    hosts = [Host("h1", 2), Host("h2", 2)]
    forever = Blacklist()
    forever.add("h2")
    assert forever.apply(hosts) == [Host("h1", 2)] and forever.for_good() == ["h2"]
    brief = Blacklist(cooldown=(0.0, 0.0))
    brief.add("h1")
    assert brief.apply(hosts) == hosts and brief.for_good() == []  # the cooldown is over at once


def test_a_host_is_blacklisted_only_when_its_ranks_fail_repeatedly() -> None:
    """One lost rank is a process that died: its host keeps every slot; the third within a minute blacklists the
    host, for a time in the cooldown range or, without one, for good (then no fixed host can make --min-np)."""
    hosts = [Host("h1", 2), Host("h2", 2)]
    blacklist = Blacklist()
    assert blacklist.failed("h1") == (1, None) and blacklist.failed("h1") == (2, None)
    assert blacklist.apply(hosts) == hosts
    assert "its slot is used again (2 lost rank(s) of h1 within 60 s; 3 blacklist it)" in \
        describe_failure("h1", 2, None)
    assert blacklist.failed("h1") == (3, float("inf"))
    assert blacklist.apply(hosts) == [Host("h2", 2)] and blacklist.for_good() == ["h1"]
    assert describe_failure("h1", 3, float("inf")) == ("host h1 blacklisted for good (no --blacklist-cooldown-range): "
                                                       "3 of its ranks lost within 60 s")
    assert hopeless(hosts, ["h1"], 2) == "" and hopeless(None, ["h1"], 3) == ""  # (a discovery script may add some)
    assert "the other fixed hosts have 2 slot(s), fewer than --min-np 3" in hopeless(hosts, ["h1"], 3)
    cooled = Blacklist(cooldown=(5.0, 5.0))
    for _ in range(REPEATED_FAILURES):
        failures, seconds = cooled.failed("h2")
    assert (failures, seconds) == (3, 5.0) and cooled.apply(hosts) == [Host("h1", 2)] and cooled.for_good() == []
    assert cooled.failed("h2") == (1, None)  # counted afresh after a blacklisting


def test_the_remover_deletes_only_this_hosts_copy_of_the_run(tmp_path: Path) -> None:
    """What the driver runs on a host: that host's directory of the run goes, another host's copy (a shared
    file system) and everything beside the run stay; the run's directory goes with the last copy. The
    directory's name has a space and quotes: each argument reaches the remover as one word."""
    base = tmp_path / "commit dir 'x' $HOME"
    run = base / "hvdlite-elastic-0a1b2c"
    for name in (socket.gethostname(), "other-host"):
        (run / name).mkdir(parents=True)
        (run / name / "commit.pkl").write_bytes(b"state")
    beside = [base / "hvdlite-elastic-0a1b2cd" / "x", base / "keep.txt"]
    beside[0].mkdir(parents=True)
    beside[1].write_text("keep")

    def remove(job: str) -> subprocess.CompletedProcess:
        return subprocess.run(remover_command(sys.executable, str(base), job), capture_output=True, text=True,
                              timeout=60)

    assert remove("0a1b2c").returncode == 0
    assert sorted(p.name for p in run.iterdir()) == ["other-host"] and all(p.exists() for p in beside)
    (run / "other-host" / "commit.pkl").unlink()
    (run / "other-host").rmdir()
    assert remove("0a1b2c").returncode == 0 and not run.exists()
    assert remove("0a1b2c").returncode == 0  # nothing there: nothing to do
    refused = remove("../keep.txt")
    assert refused.returncode == 1 and all(p.exists() for p in beside)
    assert refused.stderr.strip() == (f"hvdlite: {socket.gethostname()}: elastic commits not removed: "
                                      "not an elastic run id: '../keep.txt'")


def test_a_failed_or_hanging_deletion_is_one_log_line_and_waits_no_longer_than_the_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.elastic.cleanup")
    remover = CommitRemover(log, timeout_s=2.0)
    where = "/dev/shm/hvdlite-elastic-0a1b2c"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=log.name):
        remover.start("h1", ["true"], {}, where)
        remover.start("h2", ["sh", "-c", "echo noise; echo 'ssh: connect to host h2 port 22: Connection refused' >&2;"
                                         " exit 255"], {}, where)
        remover.start("h3", ["sleep", "30"], {}, where)
        remover.start("h4", ["/nonexistent/mpiexec"], {}, "/x/it's here")
        remover.wait()
    elapsed = time.monotonic() - started
    assert remover.pending == {} and 2.0 <= elapsed < 10.0, elapsed
    assert sorted(r.getMessage() for r in caplog.records) == [
        "could not delete the elastic commits on host h2 (exit code 255: ssh: connect to host h2 port 22: "
        "Connection refused); delete /dev/shm/hvdlite-elastic-0a1b2c there by hand",
        "could not delete the elastic commits on host h3 (no answer within 2 s); delete "
        "/dev/shm/hvdlite-elastic-0a1b2c there by hand",
        "could not delete the elastic commits on host h4 (cannot start /nonexistent/mpiexec: No such file or "
        "directory); delete '/x/it'\"'\"'s here' there by hand"]


def test_elastic_mode_choice_under_mpich_is_restart_with_the_reason() -> None:
    """This Python's mpi4py loads pip's MPICH: it exports ULFM's functions, but in-process recovery is refused
    with the reason; auto falls back to restart and says why; restart is taken as asked."""
    from hvdlite.run.elastic.inprocess import Losses, choose_mode, finished
    from hvdlite.run.elastic.server import RankInfo
    from hvdlite.run.launchers import MPICH, Launcher
    hydra = Launcher(kind=MPICH, path="mpiexec", version="HYDRA")
    in_process, why = choose_mode("auto", hydra)
    assert not in_process and why.startswith("restart mode: MPICH") and "MPIR_CVAR_ENABLE_FT" in why, why
    assert choose_mode("restart", hydra) == (False, "restart mode (--elastic-mode restart): a lost rank restarts "
                                                    "the job from its last commit")
    with pytest.raises(ValueError, match=r"--elastic-mode in-process needs an MPI library with ULFM \(Open MPI 5"):
        choose_mode("in-process", hydra)
    assert parse_args(["--elastic-mode", "in-process", "-np", "2", "--min-np", "1", "x"]).elastic_mode == "in-process"
    # the driver's book-keeping: each lost rank counted once; the job is done when every survivor said so
    ranks = [RankInfo(0, "h", 10, 0, "done"), RankInfo(1, "h", 11, 0, "lost", 1.0), RankInfo(2, "h", 12, 0, "")]
    losses = Losses(3)
    assert [r.rank for r in losses.new(ranks)] == [1] and list(losses.new(ranks)) == [] and losses.alive == 2
    # two losses in one snapshot: each is reported with what it left, oldest first
    two = [RankInfo(0, "h", 10, 0, ""), RankInfo(1, "h", 11, 0, "lost", 2.0), RankInfo(2, "h", 12, 0, "lost", 1.0)]
    both = Losses(3)
    assert [(r.rank, both.alive) for r in both.new(two)] == [(2, 2), (1, 1)]
    assert not finished(ranks, 3)
    ranks[2].ended = "done"
    assert finished(ranks, 3) and not finished(ranks[:2], 3)


def test_in_process_resets_count_recoveries_and_silent_ranks_are_fenced_once() -> None:
    """--reset-limit in in-process mode counts the survivors' recoveries (Horovod: each re-forming of the job),
    each named by the size it left: two ranks lost before the survivors report a recovery that covers both are
    one reset; a recovery that covers only the first makes the second another reset; a recovery reported before
    the driver saw its lost rank counts once, when it does. A rank declared lost whose connection is still open
    is to be fenced, once; one whose connection closed is not."""
    from hvdlite.run.elastic.inprocess import Losses
    from hvdlite.run.elastic.server import RankInfo

    def lost(rank: int, at: float) -> RankInfo:
        return RankInfo(rank, "h", 10 + rank, 0, "lost", at)

    def survivor(*sizes: int, declared: tuple[tuple[str, int, int], ...] = ()) -> RankInfo:
        return RankInfo(0, "h", 10, 0, "", 0.0, recovered=sizes, declared_lost=declared)

    together = Losses(4)
    list(together.new([lost(2, 1.0), lost(3, 1.1)]))
    assert together.resets == 1
    together.note_recoveries([survivor(2)])
    assert together.resets == 1  # one recovery dropped both
    apart = Losses(4)
    list(apart.new([lost(2, 1.0), lost(3, 1.1)]))
    apart.note_recoveries([survivor(3)])
    assert apart.resets == 2  # the survivors dropped rank 2 first: rank 3 needs a second recovery
    apart.note_recoveries([survivor(3, 2)])
    assert apart.resets == 2
    early = Losses(4, before=1)
    early.note_recoveries([survivor(3)])
    assert early.resets == 0  # reported before the driver saw the lost rank: counted once it does
    list(early.new([lost(1, 2.0)]))
    assert early.resets == 1 and early.before == 1
    list(early.new([lost(2, 3.0)]))
    assert early.resets == 2  # lost after that recovery: another
    silent, gone = RankInfo(2, "h3", 42, 0, ""), RankInfo(3, "h4", 43, 0, "lost", 1.0)
    reporter = survivor(2, declared=(("h3", 42, 777), ("h4", 43, 778)))
    fencing = Losses(4)
    assert fencing.to_fence([reporter, silent, gone], 0.0) == [
        (silent, 777, "was declared failed by the survivors but its process is still there (stopped or wedged)")]
    assert fencing.to_fence([reporter, silent, gone], 0.0) == []  # once


def test_a_discovered_listing_below_min_np_leaves_the_running_ranks_alone(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A discovery script read while its listing is rewritten (empty), or a host between two jobs, must not
    stop ranks that cannot restart at that size anyway; a listing with --min-np slots again is a change."""
    listing = tmp_path / "hosts.txt"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    args = parse_args(["-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
                       "python", "t.py"])
    driver = ElasticDriver(args, {"PATH": "/usr/bin:/bin"}, plan_launch=None)
    server = DriverServer(lambda text: None, "secret")
    driver_log = logging.getLogger("hvdlite.run.elastic")
    driver_log.addHandler(caplog.handler)
    started_on = [Host("h1", 1), Host("h2", 1), Host("h3", 1)]
    try:
        for text, changed in [("", False), ("", False), ("h1:1\n", False), ("h1:1\n", False),
                              ("h1:1\nh2:1\n", True)]:
            listing.write_text(text)
            assert driver._hosts_changed(server, started_on) is changed, text
    finally:
        driver_log.removeHandler(caplog.handler)
        server.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["discovery lists no host: fewer than --min-np 2 slots; the running ranks go on as they are",
                      "discovery lists h1:1: fewer than --min-np 2 slots; the running ranks go on as they are"]
    assert server.generation == 1
    assert any("hosts changed (added: none; removed: h3; now h1:1,h2:1): generation 1" in r.getMessage()
               for r in caplog.records)


def test_a_users_mca_btl_replaces_in_process_modes_transport() -> None:
    """Open MPI refuses ``--mca btl`` given twice: the user's transport (say TCP only) replaces ours, every
    other ULFM flag stays, and the user's flags come after."""
    from hvdlite.run.elastic.inprocess import ULFM_MPI_ARGS, ulfm_mpi_args
    assert ulfm_mpi_args(["-x", "A"]) == [*ULFM_MPI_ARGS, "-x", "A"]
    ours = " ".join(ulfm_mpi_args(["--mca", "btl", "tcp,self", "--mca", "mpi_ft_detector_timeout", "4"]))
    assert ours == ("--with-ft ulfm --mca mpi_ft_detector true --mca async_mpi_finalize true --mca "
                    "mpi_yield_when_idle true --mca btl tcp,self --mca mpi_ft_detector_timeout 4")
    assert " ".join(ulfm_mpi_args(["-mca", "btl", "tcp,self"])).count("btl") == 1
    assert "sm,tcp,self" in ulfm_mpi_args(["--mca", "btl_tcp_if_include", "eth0"])


def test_leftover_mpich_shared_memory_is_deleted_unless_a_process_maps_it(tmp_path: Path) -> None:
    """The driver deletes the MPICH shared-memory files that appeared during a job (a rank killed in MPI_Init left
    them) and that no process maps any more: one this process maps (a job running beside it) stays, and so do
    the ones that were there before and files of other names."""
    import mmap
    old = tmp_path / "mpich_shm_old_0"
    old.write_bytes(b"x" * 4096)
    before = shm_files(str(tmp_path))
    assert before == {str(old)}
    leftover, in_use, other = tmp_path / "mpich_shm_1a2b_0", tmp_path / "mpich_shm_3c4d_0", tmp_path / "other_0"
    for path in (leftover, in_use, other):
        path.write_bytes(b"x" * 4096)
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
        assert remove_leftover_shm(before, str(tmp_path)) == [str(leftover)]
        assert mapped[:1] == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_3c4d_0", "mpich_shm_old_0", "other_0"]
