"""The registry's command records (schema 13): written in batches, read per sandbox, summed for metrics."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from warmbox.errors import InvalidArgument
from warmbox.models import MAX_COMMAND_TEXT, CommandRecord
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(tmp: Path, at: str | None = None) -> Registry:
    # its own uid ledger: these rows never run, so they must not hold real ranges of the host
    return Registry(at or tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _rec(sid: str, text: str = "true", *, kind: str = "command", ms: float = 1.0, **kw: object) -> CommandRecord:
    fields: dict[str, object] = {
        "sandbox_id": sid,
        "seq": 0,
        "kind": kind,
        "text": text,
        "text_truncated": False,
        "language": "python" if kind == "code" else "",
        "started_at": 1000.0,
        "duration_ms": ms,
        "exit_code": None if kind == "code" else 0,
        "error": "",
        "timed_out": False,
        "truncated": False,
        "oom_killed": False,
        "stdout_bytes": 0,
        "stderr_bytes": 0,
    }
    fields.update(kw)
    return CommandRecord(**fields)  # type: ignore[arg-type]


def test_records_get_a_seq_per_sandbox_in_write_order_and_read_back_whole(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    failed = _rec("sb-a", "sleep 9", exit_code=137, timed_out=True, truncated=True, oom_killed=True, error="x")
    reg.commands.add_commands([_rec("sb-a", "echo 1", stdout_bytes=2), _rec("sb-b", "ls"), failed])
    reg.commands.add_commands([_rec("sb-a", "1/0", kind="code", error="ZeroDivisionError", stderr_bytes=90)])
    got = reg.commands.commands("sb-a")
    assert [c.seq for c in got] == [1, 2, 3]
    assert [c.text for c in got] == ["echo 1", "sleep 9", "1/0"]
    assert got[0].stdout_bytes == 2 and got[0].exit_code == 0
    assert got[1] == CommandRecord(**{**failed.__dict__, "seq": 2})
    assert got[2].exit_code is None and got[2].language == "python" and got[2].error == "ZeroDivisionError"
    assert [c.seq for c in reg.commands.commands("sb-b")] == [1]
    assert reg.commands.commands("sb-none") == []


def test_paging_and_newest_first(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    reg.commands.add_commands([_rec("sb-a", f"c{i}") for i in range(10)])
    assert [c.text for c in reg.commands.commands("sb-a", 3)] == ["c0", "c1", "c2"]
    assert [c.text for c in reg.commands.commands("sb-a", 3, after_seq=3)] == ["c3", "c4", "c5"]
    assert [c.text for c in reg.commands.commands("sb-a", 2, newest_first=True)] == ["c9", "c8"]
    for bad in (-1, True, "3", 1.5):
        with pytest.raises(InvalidArgument):
            reg.commands.commands("sb-a", bad)  # type: ignore[arg-type]


def test_text_is_bounded_by_the_registry_too(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    reg.commands.add_commands([_rec("sb-a", "é" * MAX_COMMAND_TEXT), _rec("sb-a", "a" * MAX_COMMAND_TEXT)])
    cut, full = reg.commands.commands("sb-a")
    assert cut.text_truncated and len(cut.text.encode()) <= MAX_COMMAND_TEXT and set(cut.text) == {"é"}
    assert not full.text_truncated and len(full.text) == MAX_COMMAND_TEXT


def test_a_version_12_database_gains_the_commands_table(tmp_path):
    assert SCHEMA_VERSION >= 13
    reg = _registry(tmp_path)
    reg.db.conn.execute("DROP TABLE commands")
    reg.db.conn.execute("PRAGMA user_version=12")
    reg.close()
    db = sqlite3.connect(tmp_path / "r.db")
    assert "commands" not in {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    db.close()
    reg = _registry(tmp_path)
    reg.commands.add_commands([_rec("sb-a")])
    assert [c.seq for c in reg.commands.commands("sb-a")] == [1]
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_every_field_is_typed_and_bounded_by_the_registry(tmp_path, registry_at):
    """One row SQLite would refuse (NaN, a 70-bit integer, a lone surrogate) must not fail its batch."""
    reg = _registry(tmp_path, at=registry_at)
    odd = _rec(
        "sb-a",
        "echo \ud800",
        ms=float("nan"),
        exit_code=1 << 70,
        error="<b>" + "x" * 1000,
        stdout_bytes=-5,
        language="py<thon>",
        started_at=float("inf"),
    )
    reg.commands.add_commands([odd, _rec("sb-a", "next")])
    got, nxt = reg.commands.commands("sb-a")
    assert (got.text, got.duration_ms, got.exit_code, got.stdout_bytes, got.started_at) == ("echo ?", 0.0, None, 0, 0.0)
    assert got.error == "?b?" + "x" * 197 and got.language == "py?thon?"
    assert nxt.text == "next"


def test_a_sandbox_keeps_its_first_and_latest_records_and_an_export_says_some_are_missing(
    tmp_path, monkeypatch, registry_at
):
    from warmbox.engine.front import _bounded_commands
    from warmbox.storage.registry import commands

    monkeypatch.setattr(commands, "COMMANDS_HEAD", 3)
    monkeypatch.setattr(commands, "COMMANDS_TAIL", 5)
    reg = _registry(tmp_path, at=registry_at)
    for start in range(0, 25, 4):  # batches, as the command log writes them
        reg.commands.add_commands(
            [_rec("sb-a", f"c{i}") for i in range(start, min(start + 4, 25))] + [_rec("sb-b", "x")]
        )
    assert [c.seq for c in reg.commands.commands("sb-a")] == [1, 2, 3, 21, 22, 23, 24, 25]
    assert [c.text for c in reg.commands.commands("sb-a")][-1] == "c24"
    assert [c.seq for c in reg.commands.commands("sb-b")] == list(range(1, 8))  # another sandbox's untouched
    kept, missing = _bounded_commands(reg, "sb-a", 100, 1 << 20)
    assert len(kept) == 8 and missing
    kept, missing = _bounded_commands(reg, "sb-b", 100, 1 << 20)
    assert len(kept) == 7 and not missing
