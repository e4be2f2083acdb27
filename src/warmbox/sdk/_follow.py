"""What a background command's handle and a terminal's handle share: a process followed by pid."""

from __future__ import annotations

import asyncio

from warmbox import operations as ops
from warmbox.models import CommandResult
from warmbox.sdk._ref import SandboxRef


class ProcessFollower:
    """A process of the sandbox followed over a ProcessStream: a task runs the subclass's ``_pump``
    (its output, as it comes) until the stream ends or ``disconnect()``."""

    def __init__(self, sandbox: SandboxRef, pid: int, stream: ops.ProcessStream) -> None:
        self._sb = sandbox
        self._pid = pid
        self._stream = stream
        self._task = asyncio.ensure_future(self._pump())
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an unawaited error is not logged

    async def _pump(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self._pid})"

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exit_code(self) -> int | None:
        """Its exit code once it ended (128+N if signal N ended it), else None."""
        result = self._stream.result
        return None if result is None else result.exit_code

    async def _ended(self) -> CommandResult:
        """Until its output ended: how the process ended."""
        await asyncio.shield(self._task)
        result = self._stream.result
        assert result is not None
        return result

    async def kill(self) -> bool:
        """SIGKILL to it and everything it started; False if it had ended."""
        return await self._sb._run(ops.KillProcess(self._sb.sandbox_id, self._pid))

    async def disconnect(self) -> None:
        """Stop following its output; the process keeps running (connect() again by its pid)."""
        self._stream.cancel()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
