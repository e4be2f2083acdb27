"""The transcript file format (warmbox.transcript): typed lines in a fixed order, read back exactly."""

from __future__ import annotations

import json

import pytest

from warmbox import transcript
from warmbox.errors import InvalidArgument
from warmbox.models import (
    CommandRecord,
    Lifecycle,
    NetEvent,
    SandboxInfo,
    SandboxMetrics,
    SnapshotRecord,
    StageTiming,
    State,
    Transcript,
    Transition,
)

SID = "sb-0123456789ab"


def _command(seq: int, at: float, text: str) -> CommandRecord:
    return CommandRecord(SID, seq, "command", text, False, "", at, 5.0, 0, "", False, False, False, 3, 0)


def _transcript(**kw: object) -> Transcript:
    fields: dict[str, object] = {
        "sandbox": SandboxInfo(
            sandbox_id=SID,
            tier="container",
            state=State.DESTROYED,
            created_at=100.0,
            expires_at=400.0,
            memory_mb=512,
            cpus=1.0,
            pids=256,
            template="base",
            metadata={"run": "é ✓"},
            lifecycle=Lifecycle(on_timeout="pause", idle_pause_after=60.0),
        ),
        "timings": (StageTiming(SID, "allocation", 1.5), StageTiming(SID, "runtime", 40.0, False)),
        "transitions": (
            Transition(SID, 100.0, "", "creating", "create"),
            Transition(SID, 101.0, "creating", "ready", "started"),
            Transition(SID, 110.0, "ready", "destroyed", "killed"),
        ),
        "commands": (_command(1, 102.0, "echo '<script>'"), _command(2, 105.0, "ls\nrm -rf x")),
        "net_events": (NetEvent(SID, 103.0, "connect", "pypi.org", "1.2.3.4", 443, "allow", "allow:pypi.org"),),
        "snapshots": (SnapshotRecord("snap-1", SID, 104.0, 4096),),
        "metrics": SandboxMetrics(SID, 0.5, 2.0, 10.0, 1.0, 9.0, 0, 1 << 20, 2, True),
        "exported_at": 200.0,
    }
    fields.update(kw)
    return Transcript(**fields)  # type: ignore[arg-type]


def test_lines_are_typed_and_in_time_order():
    lines = transcript.lines(_transcript())
    kinds = [x["type"] for x in lines]
    assert kinds == [
        "export",
        "sandbox",
        "timing",
        "timing",
        "transition",  # 100
        "transition",  # 101
        "command",  # 102
        "net_event",  # 103
        "snapshot",  # 104
        "command",  # 105
        "transition",  # 110
        "metrics",
    ]
    assert lines[0] == {"type": "export", "format": 1, "sandbox_id": SID, "exported_at": 200.0, "truncated": False}
    assert lines[6] == {"type": "command", **_command(1, 102.0, "echo '<script>'").__dict__}
    assert lines[8]["snapshot_id"] == "snap-1"  # what create(from_snapshot=) takes
    assert lines[1]["state"] == "destroyed" and lines[1]["lifecycle"]["on_timeout"] == "pause"


def test_ties_keep_the_kind_order():
    t = _transcript(
        transitions=(Transition(SID, 5.0, "ready", "running", "x"),),
        commands=(_command(1, 5.0, "a"),),
        net_events=(),
        snapshots=(SnapshotRecord("snap-1", SID, 5.0, 1),),
    )
    assert [x["type"] for x in transcript.lines(t)[4:7]] == ["transition", "command", "snapshot"]


@pytest.mark.parametrize("fmt", ["ndjson", "json"])
def test_both_formats_read_back_exactly(fmt):
    t = _transcript(truncated=True)
    data = transcript.dumps(t, fmt)
    assert transcript.loads(data) == t
    if fmt == "ndjson":
        assert all(json.loads(line)["type"] for line in data.decode().splitlines())
        assert data.decode().count("\n") == len(transcript.lines(t))  # newlines inside text are escaped
    else:
        assert isinstance(json.loads(data), list)


def test_write(tmp_path):
    t = _transcript()
    out = transcript.write(t, tmp_path / "x.ndjson")
    assert transcript.loads(out.read_bytes()) == t


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda ls: ls[1:], "export header"),
        (lambda ls: [*ls, {"type": "bogus"}], "unknown type 'bogus'"),
        (lambda ls: [*ls, ["not", "a", "record"]], "not a record"),
        (lambda ls: [{**ls[0], "format": 99}, *ls[1:]], "format 1"),
        (lambda ls: [*ls[:6], {**ls[6], "seq": "one"}, *ls[7:]], "line 7 \\(command\\).*seq"),
        (lambda ls: [*ls[:6], {**ls[6], "extra": 1}, *ls[7:]], "extra"),
        (lambda ls: ls[:-1], "one metrics line"),
        (lambda ls: [*ls, ls[1]], "one sandbox"),
    ],
)
def test_anything_else_is_refused_naming_the_line(mutate, match):
    lines = mutate(transcript.lines(_transcript()))
    with pytest.raises(InvalidArgument, match=match):
        transcript.from_records(lines)


def test_bad_format_name():
    with pytest.raises(InvalidArgument, match="ndjson"):
        transcript.dumps(_transcript(), "csv")  # type: ignore[arg-type]
