"""``sandbox.pty``: interactive terminals inside the sandbox (E2B's ``sandbox.pty``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from warmbox import operations as ops
from warmbox.errors import InvalidArgument
from warmbox.models import CommandResult
from warmbox.sdk._follow import ProcessFollower
from warmbox.sdk._ref import SandboxRef
from warmbox.sdk._sync import synchronize

DEFAULT_SHELL = ["/bin/bash", "-i", "-l"]


class AsyncPty:
    """``sandbox.pty``: start terminals, and reach any of them by pid (from any client)."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sb = sandbox

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        on_data: Callable[[bytes], object] | None = None,
        cmd: str | list[str] | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        tag: str = "",
        user: str = "user",
    ) -> AsyncPtyHandle:
        """A terminal of ``cols`` x ``rows`` running ``cmd`` (default: an interactive login bash)
        with TERM=xterm-256color. Its output (raw bytes, escape sequences included) goes to
        ``on_data`` as it comes. It runs until its process ends or is killed, whoever watches it.
        user: "user" or "root" (as in commands.run)."""
        sb = self._sb
        argv = DEFAULT_SHELL if cmd is None else cmd
        pid = await sb._run(
            ops.StartProcess(sb.sandbox_id, argv, envs=envs, cwd=cwd, tag=tag, user=user, pty_cols=cols, pty_rows=rows)
        )
        return await self.connect(pid, on_data=on_data)

    async def connect(self, pid: int, *, on_data: Callable[[bytes], object] | None = None) -> AsyncPtyHandle:
        """A handle on a running terminal: its output from what the sandbox still holds, then live."""
        if on_data is not None and not callable(on_data):
            raise InvalidArgument("on_data must be a callable")
        stream = await self._sb._run(ops.ConnectProcess(self._sb.sandbox_id, pid, pty=True))
        return AsyncPtyHandle(self._sb, pid, stream, on_data)

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Type into a terminal (text is UTF-8; b"\\x03" is Ctrl-C)."""
        await self._sb._run(ops.SendStdin(self._sb.sandbox_id, pid, data))

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        """A terminal's new size: its programs get SIGWINCH."""
        await self._sb._run(ops.ResizePty(self._sb.sandbox_id, pid, cols, rows))

    async def kill(self, pid: int) -> bool:
        """End a terminal's process and everything it started; False if it was not running."""
        return await self._sb._run(ops.KillProcess(self._sb.sandbox_id, pid))


class AsyncPtyHandle(ProcessFollower):
    """One terminal: ``pid``, ``send_input()``, ``resize()``, ``kill()``, ``wait()``; its output goes
    to ``on_data`` (and is yielded as bytes by ``async for`` when no callback takes it)."""

    def __init__(
        self, sandbox: SandboxRef, pid: int, stream: ops.ProcessStream, on_data: Callable[[bytes], object] | None
    ) -> None:
        self._on_data = on_data
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=256)  # iteration, bounded
        super().__init__(sandbox, pid, stream)

    async def _pump(self) -> None:
        try:
            while (ev := await self._stream.next()) is not None:
                if ev.kind == "lost":
                    continue  # output the agent dropped before anyone read it: nothing to show
                if self._on_data is not None:
                    self._on_data(ev.data)
                elif self._queue.full():
                    continue  # nobody iterates: drop what does not fit, never block
                else:
                    self._queue.put_nowait(ev.data)
        finally:
            if self._queue.full():
                self._queue.get_nowait()
            self._queue.put_nowait(None)

    async def send_input(self, data: str | bytes) -> None:
        """Type into the terminal (text is UTF-8)."""
        await self._sb._run(ops.SendStdin(self._sb.sandbox_id, self._pid, data))

    async def resize(self, cols: int, rows: int) -> None:
        await self._sb._run(ops.ResizePty(self._sb.sandbox_id, self._pid, cols, rows))

    async def wait(self) -> CommandResult:
        """Until its process ends: how it ended (the output went to on_data; stdout is empty)."""
        return await self._ended()

    def __aiter__(self) -> AsyncPtyHandle:
        return self

    async def __anext__(self) -> bytes:
        data = await self._queue.get()
        if data is None:
            self._queue.put_nowait(None)  # every later call ends too
            self._task.result()  # its error, if it failed
            raise StopAsyncIteration
        return data


Pty = synchronize(AsyncPty, "Pty")
PtyHandle = synchronize(AsyncPtyHandle, "PtyHandle")

__all__ = ["AsyncPty", "AsyncPtyHandle", "Pty", "PtyHandle"]
