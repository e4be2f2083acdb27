"""The engine's command log: one CommandRecord per command, code run and followed background
process, written to the registry in batches, off the caller's path.

A record is queued when its call returns and written FLUSH_AFTER_S later together with whatever
else came meanwhile (one registry transaction per batch instead of one per command: measured in
``warmbox bench exec``). Nothing queued is lost at a sandbox's end or the process's: the engine
flushes before it destroys a sandbox, the front when it lets one go or closes, and an ``atexit``
hook at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import shlex
import threading
import time
import weakref

from warmbox.errors import WarmboxError
from warmbox.models import MAX_COMMAND_TEXT, CommandRecord, CommandResult, Execution
from warmbox.storage.registry import Registry

log = logging.getLogger("warmbox.commands")
FLUSH_AFTER_S = 0.2  # a record reaches the registry this long after its call returned, at most
FLUSH_AT = 256  # this many queued: written at the loop's next turn
MAX_PENDING = 10000  # queued records kept while the registry refuses writes (the oldest go first)
MAX_FAILURES = 3  # flushes refused in a row (each after the registry's own 30 s busy wait): then dropped

_LOGS: weakref.WeakSet[CommandLog] = weakref.WeakSet()


def bounded_text(text: str) -> tuple[str, bool]:
    """``text`` cut to MAX_COMMAND_TEXT UTF-8 bytes (on a character boundary), and whether it was."""
    if len(text) <= MAX_COMMAND_TEXT // 4:  # 4 bytes a character at most: short enough as it is
        return text, False
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_COMMAND_TEXT:
        return text, False
    return raw[:MAX_COMMAND_TEXT].decode("utf-8", "ignore"), True


def command_text(cmd: str | list[str]) -> tuple[str, bool]:
    """A command as its record shows it: a shell string as given, an argv list shell-quoted."""
    return bounded_text(cmd if isinstance(cmd, str) else shlex.join(cmd))


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (no copy for ASCII text: ``isascii`` is O(1) in CPython)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def failed(
    sandbox_id: str, kind: str, text: tuple[str, bool], language: str, started_at: float, error: BaseException
) -> CommandRecord:
    """The record of a call that raised instead of returning a result."""
    return CommandRecord(
        sandbox_id=sandbox_id,
        seq=0,
        kind=kind,
        text=text[0],
        text_truncated=text[1],
        language=language,
        started_at=started_at,
        duration_ms=(time.time() - started_at) * 1e3,
        exit_code=None,
        error=type(error).__name__,
        timed_out=False,
        truncated=False,
        oom_killed=False,
        stdout_bytes=0,
        stderr_bytes=0,
    )


def of_command(
    sandbox_id: str, kind: str, text: tuple[str, bool], started_at: float, result: CommandResult
) -> CommandRecord:
    """The record of a command (or a background process, kind "process") that ended."""
    return CommandRecord(
        sandbox_id=sandbox_id,
        seq=0,
        kind=kind,
        text=text[0],
        text_truncated=text[1],
        language="",
        started_at=started_at,
        duration_ms=result.duration_ms,
        exit_code=result.exit_code,
        error="",
        timed_out=result.timed_out,
        truncated=result.truncated,
        oom_killed=result.oom_killed,
        stdout_bytes=utf8_len(result.stdout),
        stderr_bytes=utf8_len(result.stderr),
    )


def of_execution(
    sandbox_id: str, text: tuple[str, bool], language: str, started_at: float, result: Execution
) -> CommandRecord:
    """The record of a code run (error: the exception's name, when the cell raised one)."""
    return CommandRecord(
        sandbox_id=sandbox_id,
        seq=0,
        kind="code",
        text=text[0],
        text_truncated=text[1],
        language=language,
        started_at=started_at,
        duration_ms=result.duration_ms,
        exit_code=None,
        error="" if result.error is None else (result.error.name or "Error"),
        timed_out=result.timed_out,
        truncated=result.truncated,
        oom_killed=result.oom_killed,
        stdout_bytes=utf8_len(result.stdout),
        stderr_bytes=utf8_len(result.stderr),
    )


class CommandLog:
    """The queue of records not yet written (one per engine, shared by its fronts)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._pending: list[CommandRecord] = []
        self._lock = threading.Lock()  # a sync SDK client runs its loop on a thread of its own
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._failures = 0  # flushes the registry refused in a row
        _LOGS.add(self)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, record: CommandRecord) -> None:
        """Queue a record: written within FLUSH_AFTER_S (at once without a running event loop)."""
        with self._lock:
            self._pending.append(record)
            n = len(self._pending)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if n >= FLUSH_AT:
            loop.call_soon(self.flush)
        elif self._timer is None or self._timer_loop is not loop or self._timer.cancelled():
            self._timer = loop.call_later(FLUSH_AFTER_S, self.flush)
            self._timer_loop = loop

    def flush(self) -> None:
        """Write every queued record now (one transaction). A registry that refuses the write (busy
        past its timeout, closed) keeps them queued for the next flush, bounded by MAX_PENDING."""
        with self._lock:
            batch, self._pending = self._pending, []
            timer, self._timer = self._timer, None
        if timer is not None and self._timer_loop is not None and not self._timer_loop.is_closed():
            try:
                if self._timer_loop is asyncio.get_running_loop():
                    timer.cancel()
            except RuntimeError:
                pass  # not on a loop (atexit, a sync caller): the timer finds nothing to write
        if not batch:
            return
        try:
            self._registry.commands.add_commands(batch)
            self._failures = 0
        except WarmboxError:
            self._failures += 1
            if self._failures >= MAX_FAILURES:  # not a busy moment: never let one batch block every later one
                log.error(
                    "the registry refused %d command records %d times; they are dropped", len(batch), MAX_FAILURES
                )
                self._failures = 0
                return
            with self._lock:
                self._pending[:0] = batch
                del self._pending[:-MAX_PENDING]
        except Exception:  # a bug of ours, never a reason to fail a destroy or a close: the batch is lost
            log.exception("writing %d command records failed; they are dropped", len(batch))


@atexit.register
def _flush_all() -> None:
    for log in list(_LOGS):
        log.flush()
