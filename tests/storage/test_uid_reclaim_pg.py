"""uid slots held by PostgreSQL registries that no longer exist on this host are reclaimed
(issue 39): a slot recorded as ``pg:<cluster>/<node>``'s could be judged only by a registry of the
same cluster, so a dropped cluster's slots stayed held for ever. Now a slot of another cluster is
reclaimed when no process of this host has that registry open (its lease) and the sandbox's state
directory is gone; a live one (its registry open, or its leftovers on disk) never is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from warmbox.errors import RegistryError
from warmbox.models import Limits
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, LedgerError, UidLedger

FIRST = MAX_SLOTS - 50  # a range no process of this host runs in


def _ledger(tmp: Path) -> UidLedger:
    return UidLedger(tmp / "uids", slots=1, first=FIRST)


def _hold(ledger: UidLedger, registry: str, state_dir: str | None) -> None:
    """An entry as a registry's claim leaves it (state_dir None: as an older warmbox wrote it)."""
    with ledger.locked() as led:
        assert led.claim(registry, "sb-000000000001", state_dir=state_dir or "") == FIRST
    if state_dir is None:
        entry = json.loads((ledger.dir / str(FIRST)).read_text())
        del entry["state_dir"]
        (ledger.dir / str(FIRST)).write_text(json.dumps(entry))


def _claim(ledger: UidLedger) -> int:
    with ledger.locked() as led:
        return led.claim("/nonexistent/other/registry.db", "sb-000000000002")


def test_a_slot_of_a_gone_postgresql_registry_is_reclaimed(tmp_path):
    ledger = _ledger(tmp_path)
    _hold(ledger, "pg:deadbeef/n1", str(tmp_path / "gone-state"))
    assert _claim(ledger) == FIRST
    assert ledger.holder(FIRST)["sandbox_id"] == "sb-000000000002"


@pytest.mark.parametrize("why", ["leased", "leftovers", "unrecorded"])
def test_a_slot_of_a_postgresql_registry_that_may_live_is_kept(tmp_path, why):
    ledger = _ledger(tmp_path)
    state = tmp_path / "state"
    if why == "leftovers":
        state.mkdir()  # a paused (or stopped) sandbox's files are still there
    _hold(ledger, "pg:deadbeef/n1", None if why == "unrecorded" else str(state))
    lease = ledger.lease("pg:deadbeef/n1") if why == "leased" else None  # its node runs on this host
    try:
        with pytest.raises(LedgerError):
            _claim(ledger)
        assert ledger.holder(FIRST)["sandbox_id"] == "sb-000000000001"
    finally:
        if lease is not None:
            os.close(lease)
    if why == "leased":  # its node's process ended: now it is gone
        assert _claim(ledger) == FIRST


@pytest.mark.sandbox  # a real PostgreSQL server
def test_a_dropped_clusters_slots_go_to_another_cluster_once_its_node_is_closed(pg_server, pg_fresh_dsn, tmp_path):
    ledger = _ledger(tmp_path)  # one host, one slot, two clusters
    old_dsn = pg_server.create_database()
    try:
        old = Registry(old_dsn, "n1", ledger=ledger)
        new = Registry(pg_fresh_dsn, "n1", ledger=ledger)
        try:
            state = tmp_path / "sb-old"  # not made yet: a create in progress on the old cluster's node
            assert (
                old.sandboxes.allocate("sb-0000000000a1", "container", "base", 60, Limits(), str(state), "/x") == FIRST
            )
            with pytest.raises(RegistryError, match="uid ranges"):  # its node is open: never judged
                new.sandboxes.allocate("sb-0000000000b1", "container", "base", 60, Limits(), str(tmp_path / "b1"), "/x")
            old.close()
            state.mkdir()  # ... and its sandbox's state directory still there: held
            with pytest.raises(RegistryError, match="uid ranges"):
                new.sandboxes.allocate("sb-0000000000b1", "container", "base", 60, Limits(), str(tmp_path / "b1"), "/x")
            state.rmdir()  # the old node's home went away: its slot is free
            slot = new.sandboxes.allocate(
                "sb-0000000000b1", "container", "base", 60, Limits(), str(tmp_path / "b1"), "/x"
            )
            assert slot == FIRST and ledger.holder(FIRST)["registry"] == new.key
        finally:
            old.close()
            new.close()
    finally:
        pg_server.drop_database(old_dsn)
