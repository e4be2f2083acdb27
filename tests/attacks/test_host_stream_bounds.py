"""What the guest streams to the host stays bounded on the host while nobody takes it.

Red-team finding: a background command's output followed by a client that reads slowly (the
HTTP server's NDJSON route waits for its client) was queued on the host frame by frame: the agent
sends a process's output as fast as it comes, so ``yes`` grew the host by ~200 MiB a second
until it ran out of memory. The host now keeps a bounded backlog per follower (and for all the
followers of a sandbox together) and tells the reader what it dropped (a "lost" event, as the
agent's own ring does). Likewise a hostile agent ignoring a directory watch's window, or
flooding a follower with frames that are not output, got host memory without bound while the
callback (or reader) was busy; now a GuestProtocolError."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from tests.attacks.conftest import scripted_agent
from tests.attacks.test_files_read import SMALL, PeakGrowth
from warmbox import AsyncSandbox
from warmbox import operations as ops
from warmbox import protocol as p
from warmbox.engine.guest_client import GuestClient
from warmbox.engine.session import GuestSession
from warmbox.errors import GuestProtocolError

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]


def test_a_slow_follower_of_an_output_flood_keeps_the_host_bounded(home, runc_ready):
    async def main() -> None:
        sb = await AsyncSandbox.create(tier="container", timeout=120, pool=False)
        try:
            h = await sb.commands.run("yes 0123456789abcdef0123456789abcdef", background=True)
            await h.disconnect()
            # what the NDJSON route holds for each client; ten slow clients at once
            streams = [await sb._run(ops.ConnectProcess(sb.sandbox_id, h.pid)) for _ in range(10)]
            stream = streams[0]
            try:
                with PeakGrowth() as grown:
                    await asyncio.sleep(4)  # nobody reads: hundreds of MiB come meanwhile
                assert grown.growth < SMALL, f"unread followers made the host hold {grown.growth >> 20} MiB"
                kinds = set()
                for _ in range(200):
                    ev = await stream.next()
                    assert ev is not None
                    kinds.add(ev.kind)
                    if ev.kind == "lost":
                        assert ev.size > 0
                        break
                assert "lost" in kinds, "the reader was not told that output was dropped"
            finally:
                for each in streams:
                    each.cancel()
            assert await sb.commands.kill(h.pid)
            r = await sb.commands.run("echo alive", timeout=10)
            assert r.stdout == "alive\n"
        finally:
            await sb.kill()

    asyncio.run(main())


# ---- a hostile agent (the guest is untrusted): a scripted agent on a temp socket


def _flooding_agent(path: str, stop: threading.Event) -> threading.Thread:
    """Answers a WatchDir with Ok, then sends events with no regard for the window (or an Attach
    with frames that are not output), as fast as the host takes them."""

    def script(conn: socket.socket, req: p.Message | None) -> None:
        if isinstance(req, p.WatchDir):
            conn.sendall(p.encode(p.Ok(req.id)))
            frame = p.encode(p.FsEvent(req.id, name="x" * 4000, kind=p.FsEventType.CREATE))
        else:
            assert isinstance(req, p.Attach)
            frame = p.encode(p.Ok(req.id))
        batch = frame * 64
        for _ in range((1 << 30) // len(batch)):
            if stop.is_set():
                break
            conn.sendall(batch)
        stop.wait(30)

    return scripted_agent(path, script)


@pytest.mark.parametrize("what", ["watch_dir", "commands.connect"])
def test_a_hostile_agent_flooding_a_watch_or_a_follower_gets_a_typed_error(tmp_path, what):
    path = str(tmp_path / "agent.sock")
    stop = threading.Event()
    thread = _flooding_agent(path, stop)

    async def run() -> int:
        session = GuestSession(await GuestClient.connect(path, "sb-hostile"))
        try:
            with PeakGrowth() as mem:
                if what == "watch_dir":
                    slow = asyncio.Event()
                    watch = await session.watch("/workspace", False, lambda ev: slow.wait())  # a busy callback
                    await asyncio.sleep(2)
                    slow.set()
                    with pytest.raises(GuestProtocolError):
                        await asyncio.wait_for(watch.wait(), 20)
                else:
                    out = await session.attach(1)
                    await asyncio.sleep(2)  # a reader that takes nothing for a while
                    with pytest.raises(GuestProtocolError):
                        while True:
                            await asyncio.wait_for(out.next(), 20)
            return mem.growth
        finally:
            stop.set()
            await session.close()

    growth = asyncio.run(run())
    thread.join(10)
    assert growth < SMALL, f"a hostile agent made the host hold {growth >> 20} MiB"
