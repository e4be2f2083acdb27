"""The registry's lifecycle columns (schema 7): migration from version 6, one id across a pause."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from warmbox.engine.start import StartRecord
from warmbox.errors import InvalidArgument, SandboxStateError
from warmbox.models import Lifecycle, Limits, State
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

NEW_COLUMNS = {"timeout_s", "metadata", "on_timeout", "idle_pause_after", "auto_resume", "last_used", "egress"}
# added by versions 8, 11, 12, 15 and 18
LATER_COLUMNS = (
    "auto",
    "template_version",
    "image_id",
    "requirements",
    "tier_reasons",
    "tier_rejected",
    "node",
    "runtime",
)


def _registry(tmp: Path, at: str | None = None) -> Registry:
    # its own uid ledger: these rows never run, so they must not hold real ranges of the host
    return Registry(at or tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _v6_schema() -> str:
    """Version 6's schema: today's without the columns versions 7, 8 and 10 added."""
    lines = [
        line
        for line in registry_mod.SCHEMA.splitlines()
        if not any(line.strip().startswith(c + " ") for c in (*NEW_COLUMNS, *LATER_COLUMNS))
    ]
    lines = [line for line in lines if "(node" not in line]  # version 15's index and net_links' unique pair
    last = "tenant      TEXT NOT NULL DEFAULT ''"
    text = "\n".join(lines).replace(last + ",\n);", last + "\n);")
    text = text.replace("updated_at  REAL NOT NULL,\n);", "updated_at  REAL NOT NULL\n);")
    assert text.count(last + "\n);") == 2  # the sandboxes and snapshots tables end there again
    return text


def test_a_version_6_database_migrates_and_its_paused_sandbox_resumes_under_its_id(tmp_path):
    schema = _v6_schema()
    assert "timeout_s" not in schema and "egress " not in schema and " auto " not in schema
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(schema)
    db.execute(
        "INSERT INTO sandboxes (sandbox_id, tier, template, state, created_at, expires_at, memory_mb, cpus, pids, "
        "uid_slot, runtime_id, state_dir, socket_path) VALUES "
        "('sb-00000000000b', 'container', 'base', 'paused', 1, 2, 512, 1.0, 256, 3, 'x', '/nonexistent', '/x')"
    )
    db.execute("INSERT INTO meters (sandbox_id, sampled_at, cpu_ns, final) VALUES ('sb-00000000000b', 1, 5000, 1)")
    db.execute("PRAGMA user_version = 6")
    db.commit()
    db.close()

    reg = _registry(tmp_path)
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    cols = {r[1] for r in reg.db.conn.execute("PRAGMA table_info(sandboxes)")}
    assert NEW_COLUMNS <= cols
    assert "auto" in {r[1] for r in reg.db.conn.execute("PRAGMA table_info(snapshots)")}
    # the old row reads with the defaults: no timeout recorded, no metadata, kill on timeout
    assert reg.sandboxes.timeout_of("sb-00000000000b") == 0.0
    row = reg.db.conn.execute(
        "SELECT metadata, on_timeout, idle_pause_after, auto_resume, egress FROM sandboxes WHERE sandbox_id=?",
        ("sb-00000000000b",),
    ).fetchone()
    assert row == ("{}", "kill", 0.0, 0, "")
    # a sandbox paused before the migration resumes under its own id
    reg.sandboxes.reallocate("sb-00000000000b", 120.0, Limits(), owner="test")
    info, _ = reg.sandboxes.get("sb-00000000000b")
    assert info.state is State.CREATING and reg.sandboxes.timeout_of("sb-00000000000b") == 120.0
    assert (info.requirements, info.tier_reasons, info.tier_rejected) == (None, (), {})  # named its tier
    assert [t.to_state for t in reg.sandboxes.transitions("sb-00000000000b")][-1] == "creating"
    m = reg.usage.meter("sb-00000000000b")
    assert m is not None and not m.final and m.cpu_ns == 0 and m.cpu_ns - m.base_cpu_ns == 5000  # cost goes on
    reg.sandboxes.set_state("sb-00000000000b", State.DESTROYED, "test over")
    reg.close()
    reg = _registry(tmp_path)  # opening it again is a no-op
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    reg.close()


def test_only_one_resume_takes_a_paused_sandbox_and_a_live_one_cannot_be_reallocated(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    sid = "sb-00000000000c"
    reg.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent")
    assert reg.sandboxes.timeout_of(sid) == 300.0
    with pytest.raises(SandboxStateError, match="not paused"):
        reg.sandboxes.reallocate(sid, 60.0, Limits())
    reg.sandboxes.set_state(sid, State.READY, "up")
    reg.sandboxes.set_state(sid, State.PAUSED, "paused")
    first = reg.sandboxes.reallocate(sid, 60.0, Limits())
    with pytest.raises(SandboxStateError, match="not paused"):
        reg.sandboxes.reallocate(sid, 60.0, Limits())
    assert reg.sandboxes.get(sid)[0].state is State.CREATING
    reg.sandboxes.set_state(sid, State.PAUSED, "resume failed")  # a failed resume leaves it paused
    assert reg.sandboxes.reallocate(sid, 60.0, Limits()) >= 0 and first >= 0
    reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.close()


def test_list_filters_by_metadata_subset_and_by_state(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    a, b = "sb-00000000000d", "sb-00000000000e"
    for sid, user in ((a, "ada"), (b, "bob")):
        rec = StartRecord(
            "container", "base", 300.0, Limits(), metadata={"user": user, "run": "1"}
        )  # written with the row
        reg.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", start=rec)
        reg.sandboxes.set_state(sid, State.READY, "up")
    reg.sandboxes.set_state(b, State.PAUSED, "paused")
    ids = lambda rows: [i.sandbox_id for i, _ in rows]  # noqa: E731
    assert reg.sandboxes.get(a)[0].metadata == {"user": "ada", "run": "1"}
    assert ids(reg.sandboxes.list(metadata={"run": "1"})) == [a, b]
    assert ids(reg.sandboxes.list(metadata={"run": "1", "user": "bob"})) == [b]
    assert ids(reg.sandboxes.list(metadata={"user": "eve"})) == []
    assert ids(reg.sandboxes.list(states=(State.PAUSED,))) == [b]
    assert ids(reg.sandboxes.list(states=())) == []
    # a damaged metadata column reads as none, never as an error
    reg.db.conn.execute("UPDATE sandboxes SET metadata='[1,2]' WHERE sandbox_id=?", (a,))
    assert reg.sandboxes.get(a)[0].metadata == {}
    for sid in (a, b):
        reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.close()


def test_metadata_and_query_checks():
    from warmbox.models import SandboxQuery, validate_metadata, validate_query

    assert validate_metadata(None) == {} and validate_metadata({"a": "b"}) == {"a": "b"}
    for bad in ({"a": None}, {"": "x"}, {"a\0": "x"}, {"a": "x" * 2049}, "a=b", {str(i): "v" for i in range(65)}):
        with pytest.raises(InvalidArgument):
            validate_metadata(bad)
    with pytest.raises(InvalidArgument, match="bytes"):
        validate_metadata({f"k{i}": "é" * 1000 for i in range(10)})  # under the counts, over 16 KiB
    q = validate_query(SandboxQuery(state=("running",)))  # type: ignore[arg-type]
    assert set(q.state or ()) == {State.RUNNING, State.READY}
    with pytest.raises(InvalidArgument, match="state"):
        validate_query(SandboxQuery(state=("asleep",)))  # type: ignore[arg-type]


def test_a_tier_choice_is_recorded_and_read_back(tmp_path, registry_at):
    from warmbox.models import Requirements, TierChoice

    reg = _registry(tmp_path, at=registry_at)
    sid = "sb-00000000000d"
    req = Requirements("node", trusted=False, io="compute")
    choice = TierChoice("gvisor", ("a", "b é"), {"container": "too weak"}, 1.0)
    rec = StartRecord(
        "gvisor", "base", 300.0, Limits(), requirements=req, choice=choice, lifecycle=Lifecycle("pause", 30.0, True)
    )
    reg.sandboxes.allocate(sid, "gvisor", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", start=rec)
    info, _ = reg.sandboxes.get(sid)
    assert info.lifecycle == Lifecycle("pause", 30.0, True)
    assert info.requirements == req and info.requirements.language == "javascript"
    assert info.tier_reasons == ("a", "b é") and info.tier_rejected == {"container": "too weak"}
    reg.db.conn.execute('UPDATE sandboxes SET requirements=\'{"io": "disk"}\' WHERE sandbox_id=?', (sid,))
    assert reg.sandboxes.get(sid)[0].requirements is None  # a row it cannot read is no requirements, not an error
    reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.close()


def test_a_pool_claim_writes_the_callers_start_record(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    sid = "sb-00000000000f"
    reg.sandboxes.allocate(
        sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", pool="p", shape="s"
    )
    reg.sandboxes.set_state(sid, State.POOLED, "warmed up")
    with reg.db.tx() as db:  # warmed up long ago
        db.execute("UPDATE sandboxes SET last_used=1 WHERE sandbox_id=?", (sid,))
    rec = StartRecord(
        "container", "base", 300.0, Limits(), metadata={"job": "7"}, lifecycle=Lifecycle("pause", 60.0, False)
    )
    info, _ = reg.pools.claim("p", "s", 120.0, "me", None, rec)
    assert info.sandbox_id == sid and info.metadata == {"job": "7"}
    assert info.lifecycle == Lifecycle("pause", 60.0, False)
    assert (
        reg.db.conn.execute("SELECT last_used FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()[0] > 1
    )  # idle from now
    reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.close()


def test_a_start_records_secret_values_never_reach_the_registry(tmp_path, registry_at):
    from warmbox.network.policy import Policy, Secret

    reg = _registry(tmp_path, at=registry_at)
    sid = "sb-000000000010"
    value = "s3cret-value-9f2c"
    rec = StartRecord(
        "container",
        "base",
        300.0,
        Limits(),
        metadata={"k": "v"},
        network=Policy.of("internet"),
        secrets={"TOKEN": Secret(value, ["api.example.com"])},
    )
    assert value not in repr(rec)
    reg.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", start=rec)
    row = reg.db.conn.execute("SELECT * FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()
    assert "v" in str(row) and value not in str(row)
    reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.close()
