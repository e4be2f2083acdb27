"""Port forwards: a listener on this host whose every accepted connection is relayed to a port inside the sandbox.

Each accepted connection becomes one ``ports.connect`` operation (a tunnel over the agent's
connection, in process or through a server): the sandbox gets no network by it, and a forward
reaches only the port it was made for. A connection made while nothing listens yet waits up to
CONNECT_WAIT_S for a server to start (a background command), then is closed. A forward ends with
its sandbox (the first connection that finds the sandbox gone closes it) or when the Sandbox
object closes or kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time

from warmbox import operations as ops
from warmbox.errors import PortNotListening, SandboxNotFound, SandboxPaused, SandboxStateError, WarmboxError
from warmbox.sdk.transport import Transport

MAX_CONNECTIONS = 64  # per forward: a connection storm is refused beyond this, not queued
CONNECT_WAIT_S = 5.0  # how long a connection waits for a server in the sandbox to listen on the port
_READ = 256 << 10


class PortForward:
    """One listener (TCP on 127.0.0.1, or a unix socket in a private 0700 directory) for one
    sandbox port. ``host`` is what get_host returns. Use on one event loop."""

    def __init__(self, transport: Transport, sandbox_id: str, port: int, unix: bool) -> None:
        self._transport = transport
        self.sandbox_id = sandbox_id
        self.port = port
        self.unix = unix
        self.host = ""
        self._server: asyncio.Server | None = None
        self._dir: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def start(self) -> str:
        if self.unix:
            self._dir = tempfile.mkdtemp(prefix="warmbox-port-")  # 0700: only this user may connect
            path = os.path.join(self._dir, f"{self.sandbox_id}-{self.port}.sock")
            self._server = await asyncio.start_unix_server(self._accept, path, limit=_READ)
            self.host = path
        else:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, limit=_READ)
            self.host = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.host

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self.closed or len(self._tasks) >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        assert task is not None
        self._tasks.add(task)
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            if not self.closed:
                raise
            # our own close(): end normally (Python 3.11's start_server logs a cancelled handler as an error)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            try:
                stream = await self._transport.handle(ops.PortConnect(self.sandbox_id, self.port))
                break
            except PortNotListening:
                if time.monotonic() >= deadline:
                    return  # still nothing listens: this connection is closed
                await asyncio.sleep(0.1)  # a server still starting (a background command): wait for it
            except SandboxPaused:
                return  # paused (not created to auto-resume): this connection is closed; resumed, it serves again
            except (SandboxNotFound, SandboxStateError):
                self._close_soon()  # the sandbox is gone: the forward goes with it
                return
            except WarmboxError:
                return  # the agent is unreachable: this connection is closed
        try:
            up = asyncio.ensure_future(self._upstream(reader, stream))
            try:
                while (data := await stream.read()) is not None:
                    writer.write(data)
                    await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
                await up  # the server finished: the client's side may still be sending
            finally:
                up.cancel()
                with contextlib.suppress(BaseException):
                    await up
        except (WarmboxError, OSError, ConnectionError):
            pass  # either end broke: the client's connection is dropped
        finally:
            stream.close()

    @staticmethod
    async def _upstream(reader: asyncio.StreamReader, stream: ops.PortStream) -> None:
        while data := await reader.read(_READ):
            await stream.write(data)
        await stream.write_eof()

    def _close_soon(self) -> None:
        if not self.closed:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.close()))

    async def close(self) -> None:
        """Stop listening and drop every relayed connection; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["CONNECT_WAIT_S", "MAX_CONNECTIONS", "PortForward"]
