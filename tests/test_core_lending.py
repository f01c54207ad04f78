"""Idle cores lent between co-located workers: the lender's file, the borrower's thread count,
the hold after a hand-off, and the cores and files the cluster plans for each worker."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from coordinator.cluster import Cluster
from coordinator.cluster_config import ActorResources, ClusterConfig
from workers import core_lending
from workers.core_lending import CoreLending, SharedCores, lending_path, remove_lendings


def _on_own_thread(fn):
    """``fn()`` on a fresh thread (torch's thread count is per thread there)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _pair(tmp_path, lender_threads: int = 1) -> tuple[CoreLending, CoreLending]:
    """A lender alone (``lender_threads``) and a one-thread worker borrowing from it."""
    lender = CoreLending(SharedCores(str(tmp_path / "d0")), lender_threads)
    borrower = CoreLending(SharedCores(str(tmp_path / "p0"), (str(tmp_path / "d0"),)), 1)
    return lender, borrower


def _step(worker: CoreLending) -> int:
    """The threads ``worker``'s next busy step runs on."""
    worker.before_step(True)
    return torch.get_num_threads()


def test_a_borrower_runs_its_own_threads_plus_an_idle_lenders(tmp_path):
    lender, borrower = _pair(tmp_path, lender_threads=3)

    def borrowing():
        idle = _step(borrower), borrower.threads
        lender.before_step(True)
        busy = _step(borrower), borrower.threads
        lender.before_step(False)
        return idle, busy, _step(borrower), borrower.num_borrowing_steps

    idle, busy, again, borrowing_steps = _on_own_thread(borrowing)
    assert idle == (4, 4) and busy == (1, 1) and again == 4
    assert borrowing_steps == 2


def test_the_lender_file_changes_only_when_idleness_does(tmp_path):
    lender = CoreLending(SharedCores(str(tmp_path / "d0")), 2)
    assert (tmp_path / "d0").read_bytes() == bytes((core_lending.IDLE, 2))
    lender.before_step(True)
    assert (tmp_path / "d0").read_bytes() == bytes((core_lending.BUSY, 2))
    (tmp_path / "d0").write_bytes(bytes((7, 7)))
    lender.before_step(True)  # no change: not rewritten
    assert (tmp_path / "d0").read_bytes() == bytes((7, 7))
    lender.close()
    assert not (tmp_path / "d0").exists()


def test_a_lender_on_another_host_lends_nothing_and_is_looked_for_again(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(core_lending.time, "monotonic", lambda: now[0])
    path = str(tmp_path / "elsewhere")
    borrower = CoreLending(SharedCores(str(tmp_path / "p0"), (path,)), 1)
    assert _on_own_thread(lambda: _step(borrower)) == 1
    CoreLending(SharedCores(path), 1)  # it starts later on this host
    assert _on_own_thread(lambda: _step(borrower)) == 1  # not looked for again yet
    now[0] += core_lending.RECHECK_MISSING_S
    assert _on_own_thread(lambda: _step(borrower)) == 2


def test_after_a_handoff_lenders_count_as_busy_until_seen_busy_or_the_hold_ends(
    tmp_path, monkeypatch
):
    now = [100.0]
    monkeypatch.setattr(core_lending.time, "monotonic", lambda: now[0])
    lender, borrower = _pair(tmp_path)
    borrower.handed_off()
    assert _on_own_thread(lambda: _step(borrower)) == 1  # idle on file, but held
    now[0] += core_lending.HANDOFF_HOLD_S
    assert _on_own_thread(lambda: _step(borrower)) == 2  # the hold ran out
    borrower.handed_off()
    lender.before_step(True)
    assert _on_own_thread(lambda: _step(borrower)) == 1
    lender.before_step(False)  # seen busy, then idle again: its own word counts
    assert _on_own_thread(lambda: _step(borrower)) == 2


def test_a_corrupt_lender_file_lends_nothing(tmp_path):
    (tmp_path / "d0").write_bytes(b"\x01")
    borrower = CoreLending(SharedCores(str(tmp_path / "p0"), (str(tmp_path / "d0"),)), 1)
    assert _on_own_thread(lambda: _step(borrower)) == 1


def test_an_idle_borrower_keeps_its_threads_until_its_next_step(tmp_path):
    lender, borrower = _pair(tmp_path)

    def idle_then_busy():
        first = _step(borrower)
        lender.before_step(True)
        borrower.before_step(False)  # idle: nothing to run, nothing reset
        return first, torch.get_num_threads(), _step(borrower)

    assert _on_own_thread(idle_then_busy) == (2, 2, 1)


def test_the_cleanup_removes_only_this_clusters_files(tmp_path, monkeypatch):
    monkeypatch.setattr(core_lending, "SHM_DIR", tmp_path)
    mine = [lending_path("abc", role, 0) for role in ("prefill", "decode")]
    for path in mine:
        CoreLending(SharedCores(path), 1)
    other = lending_path("xyz", "decode", 0)
    CoreLending(SharedCores(other), 1)
    remove_lendings("abc")
    assert not any(os.path.exists(path) for path in mine)
    assert os.path.exists(other)


def _planned(share: bool, cores: list[int] | None, **config):
    cluster = Cluster(ClusterConfig(share_idle_cores=share, **config))
    cluster._cores = cores
    one, cfg = ActorResources(1.0), cluster.config
    roles = cluster._role_cores([one] * cfg.num_prefill, [one] * cfg.num_decode)
    return roles, cluster._sharing(cfg.num_prefill, cfg.num_decode), cluster


def test_sharing_pins_each_worker_to_its_cores_and_the_other_roles():
    (prefill, decode), (lend_p, lend_d), cluster = _planned(
        True, [0, 1, 2], num_prefill=2, num_decode=1
    )
    assert prefill == [(0, 2), (1, 2)] and decode == [(0, 1, 2)]
    # each lender has one borrower: no core is lent twice
    assert [s.borrow_paths for s in lend_p] == [(lend_d[0].lend_path,), ()]
    assert lend_d[0].borrow_paths == tuple(s.lend_path for s in lend_p)
    assert all(s.low_priority for s in lend_p) and not lend_d[0].low_priority
    assert all(cluster._id in s.lend_path for s in [*lend_p, *lend_d])


def test_without_sharing_each_worker_keeps_its_own_cores_and_lends_nothing():
    (prefill, decode), sharing, _ = _planned(False, [0, 1])
    assert prefill == [(0,)] and decode == [(1,)]
    assert sharing == ([None], [None])


def test_unpinned_workers_share_by_thread_count_alone():
    (prefill, decode), (lend_p, _), _ = _planned(True, None)
    assert prefill == [None] and decode == [None]
    assert lend_p[0] is not None and lend_p[0].borrow_paths


@pytest.mark.parametrize("raw", [True, False])
def test_the_backend_key_reaches_the_cluster_config(raw):
    from coordinator.config import defaults
    from coordinator.served_model import ServedModels, cluster_config

    overrides = {"backend_config.share_idle_cores": raw}
    cluster = cluster_config(defaults().with_overrides(overrides), ServedModels(None, None))
    assert cluster.share_idle_cores is raw
