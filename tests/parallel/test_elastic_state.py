"""hvd.elastic State inside the ranks: commit/restore, sync from rank 0, sync from the newest commit that
any host keeps (hosts told apart by name), and elastic.run without a driver."""
from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.core.elastic import state as store_module
from hvdlite.core.elastic.state import CommitStore

MPI_SIZES = (2, 3)


def test_commit_then_restore_returns_to_the_commit(rank: int) -> None:
    state = hvd.elastic.ObjectState(epoch=0, weights=np.zeros(3))
    state.epoch, state.weights = 4, np.full(3, float(rank))
    state.commit()
    state.epoch = 9
    state.weights += 100
    state.restore()
    assert state.epoch == 4 and state.commit_counter == 1
    np.testing.assert_array_equal(state.weights, np.full(3, float(rank)))


def test_sync_without_commits_takes_rank_0s_values(rank: int) -> None:
    state = hvd.elastic.ObjectState(epoch=rank + 10, weights=np.arange(3.0) * (rank + 1))
    state.sync()
    assert state.epoch == 10 and state.commit_counter == 0
    np.testing.assert_array_equal(state.weights, np.arange(3.0))


def test_sync_takes_the_newest_commit_any_host_holds(rank: int, size: int, reinit, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    job = hvd.broadcast_object(uuid.uuid4().hex, 0, name="test.job")
    reinit(elastic_commit_dir=str(tmp_path))
    monkeypatch.setenv("HVDLITE_ELASTIC_JOB", job)
    monkeypatch.setattr(store_module.socket, "gethostname", lambda: f"pretend{rank}")
    newest = size - 2  # not the last rank, not always rank 0: the lowest rank with the top counter
    state = hvd.elastic.ObjectState(step=rank, weights=np.full(2, float(rank)))
    CommitStore(str(tmp_path), job).write(7 if rank == newest else 3, state._snapshot())
    state.step, state.weights = -1, np.zeros(2)
    state.sync()
    assert state.commit_counter == 7 and state.step == newest
    np.testing.assert_array_equal(state.weights, np.full(2, float(newest)))
    # the next commit goes on from the agreed counter and lands in this host's own store
    state.step = 100 + rank
    state.commit()
    assert state.commit_counter == 8
    kept = CommitStore(str(tmp_path), job)
    assert kept.path.parent.name == f"pretend{rank}"
    assert kept.read()[0] == (8 if hvd.local_rank() == 0 else 7 if rank == newest else 3)


def test_a_commit_held_only_in_memory_is_kept_on_leaving_but_never_over_a_newer_one(
        rank: int, reinit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Survivors below --min-np leave with keep(if_newer=True): the host's writer may have died before writing the
    commit they hold (the CI soak once resumed one commit behind, 6 steps lost)."""
    job = hvd.broadcast_object(uuid.uuid4().hex, 0, name="test.job.keep")
    reinit(elastic_commit_dir=str(tmp_path))
    monkeypatch.setenv("HVDLITE_ELASTIC_JOB", job)
    monkeypatch.setattr(store_module.socket, "gethostname", lambda: f"pretend{rank}")
    store = CommitStore(str(tmp_path), job)
    state = hvd.elastic.ObjectState(step=rank)
    state.save()
    state.commit_counter = 19
    store.write(18, {"step": ("value", -1)})
    state.keep(if_newer=True)
    assert store.read() == ((19, state._saved) if hvd.local_rank() == 0 else (18, {"step": ("value", -1)}))
    store.write(20, {"step": ("value", -2)})
    state.keep(if_newer=True)  # the store's is newer: left alone
    assert store.read() == (20, {"step": ("value", -2)})


def test_a_host_without_commit_gets_the_state_by_broadcast(rank: int, reinit, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    job = hvd.broadcast_object(uuid.uuid4().hex, 0, name="test.job2")
    reinit(elastic_commit_dir=str(tmp_path))
    monkeypatch.setenv("HVDLITE_ELASTIC_JOB", job)
    monkeypatch.setattr(store_module.socket, "gethostname", lambda: f"fresh{rank}")
    state = hvd.elastic.ObjectState(step=0)
    if rank == 1:
        state.step = 42
        CommitStore(str(tmp_path), job).write(5, state._snapshot())
    state.step = -rank
    state.sync()
    assert (state.step, state.commit_counter) == (42, 5)


def test_run_without_a_driver_syncs_and_returns(rank: int) -> None:
    state = hvd.elastic.ObjectState(value=rank)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @hvd.elastic.run
    def train(state, scale):
        state.commit()  # no driver: no host check, nothing raised
        return state.value * scale

    assert train(state, 3) == 0
    assert calls == []  # reset callbacks run only after a restart
