"""``sandbox.commands``: run processes inside the sandbox."""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any, Literal, overload

from warmbox import operations as ops
from warmbox.errors import CommandFailed, InvalidArgument
from warmbox.models import CommandRecord, CommandResult, ProcessInfo
from warmbox.sdk._follow import ProcessFollower
from warmbox.sdk._ref import SandboxRef
from warmbox.sdk._sync import synchronize

DEFAULT_COMMAND_TIMEOUT_S = 60.0
DEFAULT_MAX_OUTPUT = 10 << 20
Stdin = str | bytes | Iterable[str | bytes] | AsyncIterable[str | bytes]
_DONE = object()


async def _chunks(stdin: Iterable[str | bytes] | AsyncIterable[str | bytes]) -> AsyncIterable[str | bytes]:
    """The items of a sync or async iterable; a sync one is read on its own thread (it may block,
    as a pipe does), which is left behind if the command ends first (a daemon: it never holds up
    the interpreter's exit)."""
    if isinstance(stdin, AsyncIterable):
        async for item in stdin:
            yield item
        return
    import threading

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=4)
    it = iter(stdin)

    def read() -> None:
        try:
            for item in it:
                asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()
            asyncio.run_coroutine_threadsafe(queue.put(_DONE), loop).result()
        except BaseException as e:  # the loop is gone, or the iterable failed: the reader says so
            try:
                asyncio.run_coroutine_threadsafe(queue.put(e), loop).result()
            except BaseException:
                pass

    threading.Thread(target=read, name="warmbox-stdin", daemon=True).start()
    while (got := await queue.get()) is not _DONE:
        if isinstance(got, BaseException):
            raise got
        yield got  # type: ignore[misc]  # an item of the iterable


def _check_max_output(max_output: object) -> None:
    if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output <= 0:
        raise InvalidArgument(f"max_output must be a positive number of bytes, got {max_output!r}")


def _checked(result: CommandResult, check: bool, sandbox_id: str) -> CommandResult:
    """``result``, or with ``check`` on a non-zero exit CommandFailed carrying it."""
    if check and not result.ok:
        raise CommandFailed(f"command exited with {result.exit_code}", sandbox_id, result)
    return result


class AsyncCommands:
    """``sandbox.commands``: run processes inside the sandbox."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sb = sandbox

    @overload
    async def run(
        self,
        cmd: str | list[str],
        *,
        background: Literal[False] = False,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        stdin: Stdin | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        check: bool = False,
        tag: str = "",
        user: Literal["user", "root"] = "user",
        idempotency_key: str | None = None,
    ) -> CommandResult: ...

    @overload
    async def run(
        self,
        cmd: str | list[str],
        *,
        background: Literal[True],
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        stdin: Stdin | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        check: bool = False,
        tag: str = "",
        user: Literal["user", "root"] = "user",
        idempotency_key: str | None = None,
    ) -> AsyncCommandHandle: ...

    async def run(
        self,
        cmd: str | list[str],
        *,
        background: bool = False,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        stdin: Stdin | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        check: bool = False,
        tag: str = "",
        user: Literal["user", "root"] = "user",
        idempotency_key: str | None = None,
    ) -> CommandResult | AsyncCommandHandle:
        """Run ``cmd`` (a shell string for bash, or an argv list) and wait for it.

        background=True: start it and return a :class:`AsyncCommandHandle` at once (pid, wait(),
        kill(), send_stdin(), its output in on_stdout/on_stderr and by iteration). It runs until
        it ends or is killed, whether or not anyone reads it; ``timeout`` does not apply, and
        ``stdin`` is sent right after the start (the process's stdin stays open: send_stdin).
        tag: a label shown by ``list()``.
        user: "user" (the sandbox user, default) or "root": uid 0 of a user namespace nested in the
        sandbox's, with every capability there but no more reach than the sandbox user
        (``Capabilities.root_user``; Unsupported on a tier without it, naming why).
        stdin: text or bytes, or an iterable (sync or async) of them, streamed to the command as
        they come and closed at their end (a sync one is read on a thread of its own).

        timeout: seconds, wall clock (None or 0: no limit); on expiry every process the command
        started is killed, double-forked and setsid()ed ones included, and ``timed_out`` is set.
        What it starts and leaves running when it exits normally (``nohup server &``) stays;
        a runaway one is bounded by limits.pids and limits.cpus. On gVisor a command runs in its
        own PID namespace: ``$$`` counts from 2 there while ``ps`` shows the sandbox's pids, and a
        command cannot signal what another one started (guest/scopes.py).
        Output beyond ``max_output`` bytes (stdout+stderr) is dropped and ``truncated`` set.
        ``check=True`` raises CommandFailed on a non-zero exit.
        idempotency_key: a repeat of this call with the same key (on this sandbox) never runs the
        command again: it gets the first run's result (output up to 64 KiB per stream), or waits
        for it if it still runs; the same key with another command is IdempotencyConflict, and
        OutcomeUnknown if the server that ran it ended before recording its result. For a
        foreground command (not background, stdin as text or bytes, user="user").
        """
        sb = self._sb
        streamed = stdin is not None and not isinstance(stdin, (str, bytes))
        if idempotency_key is not None and (background or streamed or user != "user"):
            raise InvalidArgument(
                "idempotency_key is for a foreground command with text or bytes stdin as the sandbox user"
            )
        if background or streamed or user != "user":
            _check_max_output(max_output)  # before the process starts: nothing to follow it otherwise
            # started and followed in one round trip; a foreground command's stdin is empty, as with Exec
            stream = await sb._run(
                ops.StartAndConnect(
                    sb.sandbox_id, cmd, envs=envs, cwd=cwd, tag=tag, user=user, stdin=background or stdin is not None
                )
            )
            handle = AsyncCommandHandle(sb, stream.pid, stream, on_stdout, on_stderr, max_output)
            if isinstance(stdin, (str, bytes)):
                await handle.send_stdin(stdin, eof=not background)
            feeder = (
                None if stdin is None or isinstance(stdin, (str, bytes)) else asyncio.ensure_future(handle._feed(stdin))
            )
            if background:
                if feeder is not None:
                    handle._feeder = feeder
                return handle
            return _checked(await handle._finish(feeder, timeout), check, sb.sandbox_id)
        result = await sb._run(
            ops.Exec(
                sb.sandbox_id,
                cmd,
                envs=envs,
                cwd=cwd,
                timeout=timeout,
                stdin=stdin if isinstance(stdin, (str, bytes)) else None,
                max_output=max_output,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                idempotency_key=idempotency_key,
            )
        )
        return _checked(result, check, sb.sandbox_id)

    async def _follow(
        self,
        pid: int,
        on_stdout: Callable[[str], object] | None,
        on_stderr: Callable[[str], object] | None,
        max_output: int,
    ) -> AsyncCommandHandle:
        _check_max_output(max_output)
        stream = await self._sb._run(ops.ConnectProcess(self._sb.sandbox_id, pid))
        return AsyncCommandHandle(self._sb, pid, stream, on_stdout, on_stderr, max_output)

    async def connect(
        self,
        pid: int,
        *,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> AsyncCommandHandle:
        """A handle on a background process started by anyone (another process, another client):
        its output from what the sandbox still holds of it (a bounded ring; a "lost" note says
        how much was dropped), then live. Works after it ended too (its exit status is kept for a while)."""
        return await self._follow(pid, on_stdout, on_stderr, max_output)

    async def history(
        self, limit: int = 1000, *, after_seq: int = 0, newest_first: bool = False
    ) -> builtins.list[CommandRecord]:
        """What ran in this sandbox (also once it ended): one record per ``run``, ``run_code`` cell
        and background process followed to its end, those with ``seq > after_seq``, at most
        ``limit`` (1-10000), oldest first (newest_first: the newest, newest first). Each holds the
        command's text (cut at 4 KiB), duration and outcome (exit code, timed_out, truncated,
        oom_killed, error, output byte counts): never its environment or its output."""
        return await self._sb._transport.handle(ops.Commands(self._sb.sandbox_id, limit, after_seq, newest_first))

    async def list(self) -> builtins.list[ProcessInfo]:
        """The running background processes (and terminals) of the sandbox."""
        return await self._sb._run(ops.ListProcesses(self._sb.sandbox_id))

    async def kill(self, pid: int) -> bool:
        """Kill a process and everything it started (SIGKILL); False if it was not running."""
        return await self._sb._run(ops.KillProcess(self._sb.sandbox_id, pid))

    async def send_stdin(self, pid: int, data: str | bytes, *, eof: bool = False) -> None:
        """Write to a background process's stdin (text: UTF-8); ``eof=True`` closes it after."""
        await self._sb._run(ops.SendStdin(self._sb.sandbox_id, pid, data, eof))


class AsyncCommandHandle(ProcessFollower):
    """A background command (E2B's CommandHandle): ``pid``, ``wait()``, ``kill()``, ``send_stdin()``.

    Its output goes to the callbacks given to run()/connect() as it comes, is kept (up to
    max_output bytes; ``truncated`` beyond) for ``wait()``'s CommandResult, and is yielded by
    ``async for stdout, stderr, pty in handle`` (one of the three set per item; pty is always
    None here). ``disconnect()`` stops following it; the process runs on.
    """

    def __init__(
        self,
        sandbox: SandboxRef,
        pid: int,
        stream: ops.ProcessStream,
        on_stdout: Callable[[str], object] | None,
        on_stderr: Callable[[str], object] | None,
        max_output: int,
    ) -> None:
        self._on = {"stdout": on_stdout, "stderr": on_stderr}
        self._cap = max_output
        self._kept = 0
        self._out: builtins.list[str] = []
        self._err: builtins.list[str] = []
        self._log: builtins.list[tuple[str, str]] = []  # what iteration yields, in order
        self._cursor = 0
        self._lost = 0
        self._truncated = False
        self._changed = asyncio.Event()
        self._feeder: asyncio.Future[None] | None = None  # streams an iterable given as stdin
        super().__init__(sandbox, pid, stream)

    @property
    def stdout(self) -> str:
        """Its stdout so far (what was kept)."""
        return "".join(self._out)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    async def _pump(self) -> None:
        try:
            while (ev := await self._stream.next()) is not None:
                if ev.kind == "lost":
                    self._lost += ev.size
                    continue
                text = ev.text if ev.kind in ("stdout", "stderr") else ev.data.decode("utf-8", "replace")
                kind = "stderr" if ev.kind == "stderr" else "stdout"
                size = len(text.encode())
                if self._kept + size > self._cap:
                    self._truncated = True
                else:
                    self._kept += size
                    (self._err if kind == "stderr" else self._out).append(text)
                    self._log.append((kind, text))
                callback = self._on[kind]
                if callback is not None:
                    callback(text)
                self._changed.set()
        finally:
            self._changed.set()

    async def _feed(self, stdin: Iterable[str | bytes] | AsyncIterable[str | bytes]) -> None:
        """Send ``stdin``'s items as they come, then close the process's stdin. A process that
        ended (or closed its stdin) ends the feeding quietly."""
        from warmbox.errors import ProcessNotFound

        try:
            async for item in _chunks(stdin):
                if not isinstance(item, (str, bytes, bytearray)):
                    raise InvalidArgument(f"stdin items must be str or bytes, got {type(item).__name__}")
                if item:
                    await self.send_stdin(bytes(item) if isinstance(item, bytearray) else item)
            await self.send_stdin(b"", eof=True)
        except (ProcessNotFound, InvalidArgument):
            if self._task.done():
                return
            raise

    async def _finish(self, feeder: asyncio.Future[None] | None, timeout: float | None) -> CommandResult:
        """A foreground run on the background machinery (streamed stdin): wait for the end,
        killing it at ``timeout`` (``timed_out``); a failed feeder kills it too and raises."""
        waits: set[asyncio.Future[Any]] = {self._task}
        if feeder is not None:
            waits.add(feeder)
        deadline = None if not timeout else asyncio.get_running_loop().time() + timeout
        timed_out = False
        try:
            while not self._task.done():
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    timed_out = True
                    await self.kill()
                    break
                done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if feeder is not None and feeder in done:
                    waits.discard(feeder)
                    error = None if feeder.cancelled() else feeder.exception()
                    if error is not None:
                        await self.kill()
                        raise error
            result = await self.wait()
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
        return dataclasses.replace(result, timed_out=True) if timed_out else result

    async def wait(self, *, check: bool = False) -> CommandResult:
        """Until it ends: its CommandResult with the output kept. ``truncated``: output was dropped
        (beyond max_output here, or from the sandbox's ring before anyone read it).
        check=True raises CommandFailed on a non-zero exit."""
        result = await self._ended()
        result = dataclasses.replace(
            result,
            stdout=self.stdout,
            stderr=self.stderr,
            truncated=result.truncated or self._truncated or self._lost > 0,
        )
        return _checked(result, check, self._sb.sandbox_id)

    async def send_stdin(self, data: str | bytes, *, eof: bool = False) -> None:
        await self._sb._run(ops.SendStdin(self._sb.sandbox_id, self._pid, data, eof))

    def __aiter__(self) -> AsyncCommandHandle:
        return self

    async def __anext__(self) -> tuple[str | None, str | None, bytes | None]:
        while self._cursor >= len(self._log):
            if self._task.done():
                self._task.result()  # its error, if it failed
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()
        kind, text = self._log[self._cursor]
        self._cursor += 1
        return (text, None, None) if kind == "stdout" else (None, text, None)


CommandHandle = synchronize(AsyncCommandHandle, "CommandHandle")

__all__ = ["AsyncCommandHandle", "AsyncCommands", "CommandHandle"]
