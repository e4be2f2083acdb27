"""CommandStore: the record of the commands a sandbox ran."""

from __future__ import annotations

import builtins
import math
import re

from warmbox.errors import InvalidArgument
from warmbox.models import COMMAND_KINDS, MAX_COMMAND_TEXT, CommandRecord
from warmbox.storage.registry.db import Store, _retried

COMMANDS_HEAD = 5_000  # command records a sandbox keeps from its start (its setup) ...
COMMANDS_TAIL = 5_000  # ... and from its latest (at most 10,000 rows, 40 MiB of text, per sandbox)
_COMMAND_COLUMNS = (
    "sandbox_id, seq, kind, text, text_truncated, language, started_at, duration_ms, exit_code, error, "
    "timed_out, truncated, oom_killed, stdout_bytes, stderr_bytes"
)

MAX_COMMAND_ERROR = 200  # characters of a CommandRecord's error name kept
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.:-]")
_INT64 = (1 << 63) - 1


def _finite(v: object) -> float:
    """A number a SQLite REAL column keeps (a NaN would be stored as NULL): else 0."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def _count(v: object) -> int:
    return min(max(v, 0), _INT64) if isinstance(v, int) and not isinstance(v, bool) else 0


def _command_row(c: CommandRecord, seq: int) -> tuple:
    """One CommandRecord as its commands row. Every field is bounded and typed here again, the
    registry's own rule: durations, exit codes and error names come from the guest (hostile), and
    one row SQLite refuses (a NaN, an integer past 64 bits) would fail every record of its batch."""
    text, cut = c.text, c.text_truncated
    if len(text) > MAX_COMMAND_TEXT // 4:  # only then can it be over MAX_COMMAND_TEXT bytes
        raw = text.encode("utf-8", "replace")
        if len(raw) > MAX_COMMAND_TEXT:
            text, cut = raw[:MAX_COMMAND_TEXT].decode("utf-8", "ignore"), True
    code = c.exit_code
    if isinstance(code, bool) or not isinstance(code, int) or not -_INT64 <= code <= _INT64:
        code = None
    return (
        c.sandbox_id,
        seq,
        c.kind if c.kind in COMMAND_KINDS else "command",
        text.encode("utf-8", "replace").decode() if not text.isascii() else text,  # lone surrogates: SQLite refuses
        int(bool(cut)),
        _NOT_A_NAME.sub("?", c.language[:32]),
        _finite(c.started_at),
        max(0.0, _finite(c.duration_ms)),
        code,
        _NOT_A_NAME.sub("?", c.error[:MAX_COMMAND_ERROR]),  # an exception's name: a guest may choose any
        int(bool(c.timed_out)),
        int(bool(c.truncated)),
        int(bool(c.oom_killed)),
        _count(c.stdout_bytes),
        _count(c.stderr_bytes),
    )


def _command(r: tuple) -> CommandRecord:
    return CommandRecord(
        sandbox_id=r[0],
        seq=r[1],
        kind=r[2],
        text=r[3],
        text_truncated=bool(r[4]),
        language=r[5],
        started_at=r[6],
        duration_ms=r[7],
        exit_code=r[8],
        error=r[9],
        timed_out=bool(r[10]),
        truncated=bool(r[11]),
        oom_killed=bool(r[12]),
        stdout_bytes=r[13],
        stderr_bytes=r[14],
    )


class CommandStore(Store):
    """The record of the commands a sandbox ran."""

    @_retried
    def add_commands(self, records: builtins.list[CommandRecord]) -> None:
        """Append command records in one transaction; each gets the next ``seq`` of its sandbox
        (the records' own seq is ignored), in the order given. A sandbox keeps its first
        COMMANDS_HEAD and its latest COMMANDS_TAIL records: the ones between are deleted (the gap in
        ``seq`` shows it), so a sandbox running commands at full speed cannot grow the registry
        without bound (about 900 calls/s with 4 KiB of text each was 12 GB an hour)."""
        if not records:
            return
        with self._tx(*{f"commands:{c.sandbox_id}" for c in records}) as db:  # the next seq, one writer each
            last: dict[str, int] = {}
            rows = []
            for c in records:
                n = last.get(c.sandbox_id)
                if n is None:
                    n = db.execute(
                        "SELECT COALESCE(MAX(seq), 0) FROM commands WHERE sandbox_id=?", (c.sandbox_id,)
                    ).fetchone()[0]
                last[c.sandbox_id] = n = n + 1
                rows.append(_command_row(c, n))
            db.executemany(f"INSERT INTO commands ({_COMMAND_COLUMNS}) VALUES ({','.join('?' * 15)})", rows)
            for sid, n in last.items():  # a sandbox keeps its first and its latest records, not all
                if n > COMMANDS_HEAD + COMMANDS_TAIL:
                    db.execute(
                        "DELETE FROM commands WHERE sandbox_id=? AND seq>? AND seq<=?",
                        (sid, COMMANDS_HEAD, n - COMMANDS_TAIL),
                    )

    def command_count(self, sandbox_id: str) -> int:
        """How many commands and code runs were recorded for the sandbox (the highest ``seq``: the
        records between its first and latest ones that were not kept count too)."""
        row = self._db.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM commands WHERE sandbox_id=?", (sandbox_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    def commands(
        self, sandbox_id: str, limit: int = 1000, *, after_seq: int = 0, newest_first: bool = False
    ) -> builtins.list[CommandRecord]:
        """A sandbox's command records with seq > ``after_seq``, at most ``limit``: the oldest of
        them in seq order, or (newest_first) the newest, newest first. Kept after the sandbox ended."""
        for name, value in (("limit", limit), ("after_seq", after_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be an integer >= 0, got {value!r}")
        rows = self._read(
            f"SELECT {_COMMAND_COLUMNS} FROM commands WHERE sandbox_id=? AND seq>? "
            f"ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?",
            (sandbox_id, after_seq, limit),
            many=True,
        )
        return [_command(r) for r in rows]
