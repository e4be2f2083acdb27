"""Command records and the transcript export against a real container sandbox (in process and, with
--api=http, through a server): every outcome recorded, nothing of the environment or the output."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import cli
from warmbox import Sandbox, SandboxNotFound, State, Transcript
from warmbox.transcript import loads

SECRET = "s3cr3t-value-never-recorded"


@pytest.mark.sandbox
def test_every_run_is_recorded_and_the_transcript_outlives_the_sandbox(home, runc_ready, tmp_path):
    sb = Sandbox.create(tier="container", template="base", timeout=300)
    try:
        sid = sb.sandbox_id
        ok = sb.commands.run('echo "$((6 * 7))x"; echo "$TOKEN" | wc -c >&2', envs={"TOKEN": SECRET})
        slow = sb.commands.run(["sleep", "30"], timeout=1)
        cut = sb.commands.run("head -c 100000 /dev/zero | tr '\\0' x", max_output=1000)
        boom = sb.run_code("print(6 * 7, 'y')\n1/0")
        bg = sb.commands.run("echo $((2 * 21))z; exit 3", background=True)
        assert bg.wait().exit_code == 3
        assert (ok.exit_code, slow.timed_out, cut.truncated, boom.error.name) == (0, True, True, "ZeroDivisionError")
        snap = sb.snapshot()
        assert cli("exec", sid, "--", "echo", "from-the-cli").returncode == 0  # another process, another client

        history = sb.commands.history()
        assert [c.seq for c in history] == list(range(1, len(history) + 1))
        assert [c.kind for c in history[:5]] == ["command", "command", "command", "code", "process"]
        first, timeout, truncated, code, process = history[:5]
        assert (first.text, first.exit_code, first.error, first.stdout_bytes, first.stderr_bytes) == (
            'echo "$((6 * 7))x"; echo "$TOKEN" | wc -c >&2',
            0,
            "",
            4,
            3,
        )
        assert timeout.text == "sleep 30" and timeout.timed_out and timeout.exit_code == 137
        assert 900 <= timeout.duration_ms < 10_000
        assert truncated.truncated and truncated.stdout_bytes == 1000 and not truncated.timed_out
        assert (code.language, code.error, code.exit_code, code.stdout_bytes) == (
            "python",
            "ZeroDivisionError",
            None,
            5,
        )
        assert code.text == "print(6 * 7, 'y')\n1/0"
        assert (process.text, process.exit_code, process.stdout_bytes) == ("echo $((2 * 21))z; exit 3", 3, 4)
        assert any(c.text.endswith("echo from-the-cli") and c.exit_code == 0 for c in history[5:])
        assert history[1:2] == sb.commands.history(1, after_seq=1)
        assert sb.commands.history(2, newest_first=True) == history[::-1][:2]
        for c in history:
            assert c.sandbox_id == sid and not c.oom_killed and 0 < c.started_at <= time.time()
        live = sb.export()
        assert isinstance(live, Transcript) and live.sandbox.state in (State.READY, State.RUNNING)
    finally:
        sb.kill()

    path = tmp_path / "t.ndjson"
    t = Sandbox.export_transcript(sid, path)  # destroyed: its rows are still there
    assert t == loads(path.read_bytes())
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    text = path.read_text()
    assert SECRET not in text and "TOKEN" in text  # the command's text, never its environment
    for output in ("42x", "42 y", "42z", "xxxx"):  # nothing any of them printed
        assert output not in text
    assert [x["type"] for x in lines[:2]] == ["export", "sandbox"] and lines[-1]["type"] == "metrics"
    assert lines[0]["sandbox_id"] == sid and lines[0]["truncated"] is False and lines[0]["format"] == 1
    assert t.sandbox.state is State.DESTROYED and t.metrics.final
    assert t.commands == tuple(history)
    assert {x.stage for x in t.timings} >= {"allocation", "runtime"}
    assert [(x.from_state, x.to_state) for x in t.transitions][-1][1] == "destroyed"
    assert [s.snapshot_id for s in t.snapshots] == [snap.snapshot_id]
    timed = [x for x in lines if x["type"] in ("transition", "command", "net_event", "snapshot")]
    when = [x.get("at", x.get("started_at", x.get("created_at"))) for x in timed]
    assert when == sorted(when)
    # the snapshot's id replays from that checkpoint
    again = Sandbox.create(from_snapshot=t.snapshots[0].snapshot_id, timeout=120)
    try:
        assert again.run_code("1 + 1").text == "2"
    finally:
        again.kill()

    out = tmp_path / "t.json"
    r = cli("export", sid, "-o", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert loads(out.read_bytes()).commands == t.commands
    with pytest.raises(SandboxNotFound):
        Sandbox.export_transcript("sb-000000000000")
