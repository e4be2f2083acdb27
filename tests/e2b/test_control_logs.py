"""E2B's sandbox logs are made from warmbox's runtime log tails, which hold the agent's log (the
guest's text): a line of any shape becomes an entry, never an error (no sandbox: the parser only)."""

from __future__ import annotations

from warmbox.server.e2b.control import _log_entries


def test_any_log_line_is_an_entry_and_only_a_runtimes_json_gives_time_and_level():
    started = 100.0
    lines = [
        '{"level":"error","msg":"boom","time":"2026-12-06T11:00:00Z"}',  # runc's shape
        '{"level":"warning","msg":"w","time":"0001-01-01T00:00:00"}',  # a time out of range
        '{"level":{"x":1},"msg":"odd","time":"not a time"}',
        '{"a":' + "[" * 100_000 + "]" * 100_000 + "}",  # too deep for json: text
        '{"a":' + "[" * 5_000 + "]" * 5_000 + "}",
        '{"msg": 5}',
        "plain line",
        "",
    ]
    got = _log_entries("\n".join(lines), started)
    assert got[0] == (1796554800.0, "error", "boom")
    assert got[1] == (started, "warn", "w")
    assert got[2] == (started, "info", "odd")
    assert [(at, level) for at, level, _ in got[3:]] == [(started, "info")] * 4
    assert got[-1][2] == "plain line" and len(got) == 7
