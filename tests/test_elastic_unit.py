"""ElasticShards (the core of ElasticSampler) and the elastic flag parsing, without MPI."""
from __future__ import annotations

import pytest

from hvdlite.core import runtime
from hvdlite.core.elastic import ElasticShards
from hvdlite.run.args import is_elastic, parse_args
from hvdlite.run.elastic.discovery import Blacklist, DiscoveryError, parse_discovered
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
    assert forever.apply(hosts) == [Host("h1", 2)]
    slots = Blacklist(per_slot=True)
    slots.add("h1")
    assert slots.apply(hosts) == [Host("h1", 1), Host("h2", 2)]
    brief = Blacklist(cooldown=(0.0, 0.0))
    brief.add("h1")
    assert brief.apply(hosts) == hosts  # the cooldown is over at once
