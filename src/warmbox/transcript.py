"""A sandbox's transcript as flat typed records, one JSON object per line (NDJSON): what
``warmbox export``, ``sandbox.export()`` and ``GET /v1/sandboxes/{id}/export`` give.

Each line has a ``type`` and the fields of one record of :mod:`warmbox.models`:

============  ==========================  ==============================================
type          record                      order
============  ==========================  ==============================================
export        format, sandbox_id,         first: what the file is (``format`` = FORMAT),
              exported_at, truncated      truncated: a kind had more than MAX_RECORDS
                                          (commands: or MAX_COMMAND_TEXT of text)
sandbox       SandboxInfo                 second
timing        StageTiming                 the start's stages, in stage order
transition    Transition                  \\
command       CommandRecord               | merged in time order: ``at``, ``started_at``,
net_event     NetEvent                    | ``at``, ``created_at`` (ties keep this order)
snapshot      SnapshotRecord              /
metrics       SandboxMetrics              last: the cost (final once the sandbox ended)
============  ==========================  ==============================================

Replay from a known checkpoint: every ``snapshot`` line carries the ``snapshot_id`` that
``Sandbox.create(from_snapshot=snapshot_id)`` (or ``warmbox resume SNAP``) starts a new sandbox
from, with the files and code-context state of that moment, as long as the snapshot exists; the
``command`` lines after it are what ran next. Commands are recorded without their environment
and without their output (byte counts and outcome only); every text field is the sandbox user's
input, to be escaped wherever it is shown.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from warmbox import wire
from warmbox.errors import InvalidArgument
from warmbox.models import (
    CommandRecord,
    NetEvent,
    SandboxInfo,
    SandboxMetrics,
    SnapshotRecord,
    StageTiming,
    Transcript,
    Transition,
)

FORMAT = 1
MAX_RECORDS = 100_000  # of each kind (commands, network events, transitions) in one transcript
# the command text one transcript holds (a record's text is up to 4 KiB: 100k of them made a 440 MB
# file and a 1.4 GB server process); past it the transcript ends early, ``truncated`` set
MAX_COMMAND_TEXT = 32 << 20
Format = Literal["ndjson", "json"]
TYPES: dict[str, type] = {
    "sandbox": SandboxInfo,
    "timing": StageTiming,
    "transition": Transition,
    "command": CommandRecord,
    "net_event": NetEvent,
    "snapshot": SnapshotRecord,
    "metrics": SandboxMetrics,
}
_MERGED = ("transition", "command", "net_event", "snapshot")  # tie order of the time-ordered part


def _line(kind: str, record: object) -> dict[str, Any]:
    return {"type": kind, **wire.encode(record)}


def lines(t: Transcript) -> list[dict[str, Any]]:
    """The transcript's lines as JSON-ready dicts, in file order (see the module docstring)."""
    timed: list[tuple[float, int, int, dict[str, Any]]] = []
    groups: tuple[tuple[str, Iterable[Any], str], ...] = (
        ("transition", t.transitions, "at"),
        ("command", t.commands, "started_at"),
        ("net_event", t.net_events, "at"),
        ("snapshot", t.snapshots, "created_at"),
    )
    for rank, (kind, items, when) in enumerate(groups):
        for i, rec in enumerate(items):
            timed.append((float(getattr(rec, when)), rank, i, _line(kind, rec)))
    timed.sort(key=lambda x: x[:3])
    head = {
        "type": "export",
        "format": FORMAT,
        "sandbox_id": t.sandbox.sandbox_id,
        "exported_at": t.exported_at,
        "truncated": t.truncated,
    }
    return [
        head,
        _line("sandbox", t.sandbox),
        *(_line("timing", x) for x in t.timings),
        *(x[3] for x in timed),
        _line("metrics", t.metrics),
    ]


def from_records(items: Iterable[object]) -> Transcript:
    """A transcript from its lines as parsed JSON; InvalidArgument
    naming the line for anything that is not one (an unknown type, a field missing or mistyped)."""
    head: dict[str, Any] | None = None
    found: dict[str, list[Any]] = {k: [] for k in TYPES}
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise InvalidArgument(f"transcript line {n}: not a record with a type")
        data = dict(item)
        kind = data.pop("type")
        if kind == "export":
            if n != 1 or data.get("format") != FORMAT:
                raise InvalidArgument(f"transcript line {n}: an export header of format {FORMAT} comes first only")
            head = data
            continue
        cls = TYPES.get(kind)
        if cls is None:
            raise InvalidArgument(f"transcript line {n}: unknown type {kind!r}")
        found[kind].append(wire.decode_record(cls, data, f"transcript line {n} ({kind})"))
    if head is None or len(found["sandbox"]) != 1 or len(found["metrics"]) != 1:
        raise InvalidArgument("a transcript has one export header, one sandbox and one metrics line")
    exported_at = head.get("exported_at")
    if isinstance(exported_at, bool) or not isinstance(exported_at, (int, float)):
        raise InvalidArgument("the transcript's export header has no exported_at")
    return Transcript(
        sandbox=found["sandbox"][0],
        timings=tuple(found["timing"]),
        transitions=tuple(found["transition"]),
        commands=tuple(found["command"]),
        net_events=tuple(found["net_event"]),
        snapshots=tuple(found["snapshot"]),
        metrics=found["metrics"][0],
        exported_at=float(exported_at),
        truncated=head.get("truncated") is True,
    )


def dumps(t: Transcript, fmt: Format = "ndjson") -> bytes:
    """The transcript as a file: NDJSON (one record a line) or JSON (an array of the same records)."""
    out = lines(t)
    if fmt == "json":
        return json.dumps(out, ensure_ascii=False, indent=1).encode() + b"\n"
    if fmt != "ndjson":
        raise InvalidArgument(f"format must be 'ndjson' or 'json', got {fmt!r}")
    return b"".join(json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for x in out)


def loads(data: bytes | str) -> Transcript:
    """A transcript file (either format) back as a Transcript."""
    text = data.decode() if isinstance(data, bytes) else data
    if text.lstrip().startswith("["):
        items = wire.loads(text)
    else:
        items = [wire.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(items, list):
        raise InvalidArgument("a transcript is NDJSON lines or a JSON array of records")
    return from_records(items)


def write(t: Transcript, path: str | os.PathLike[str], fmt: Format = "ndjson") -> Path:
    """Write the transcript to ``path`` (made or replaced; not a sandbox's path: the caller's own)."""
    out = Path(path)
    out.write_bytes(dumps(t, fmt))
    return out


__all__ = ["FORMAT", "MAX_COMMAND_TEXT", "MAX_RECORDS", "TYPES", "dumps", "from_records", "lines", "loads", "write"]
