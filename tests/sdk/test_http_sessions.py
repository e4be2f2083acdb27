"""The HTTP transports of one event loop share their sessions to a server; they close at the loop's end."""

from __future__ import annotations

import asyncio

from warmbox.sdk import http
from warmbox.sdk.http import HttpTransport


def test_transports_of_a_loop_share_a_session_kept_after_close_and_closed_at_the_loops_end():
    async def main():
        a, b = HttpTransport("unix:/nonexistent/a.sock"), HttpTransport("unix:/nonexistent/a.sock")
        other_key = HttpTransport("unix:/nonexistent/a.sock", "k2")
        sa, sb, sk = await a._client(), await b._client(), await other_key._client()
        assert sa is sb and sk is not sa  # one per server and key
        await a.close()
        await b.close()
        assert not sa.closed
        c = HttpTransport("unix:/nonexistent/a.sock")
        assert await c._client() is sa  # the next transport's: no new session, no new connection
        await c.close()
        await other_key.close()
        # past KEPT_IDLE sessions that no transport holds, the least recently released are closed
        many = [HttpTransport(f"unix:/nonexistent/{i}.sock") for i in range(http.KEPT_IDLE + 2)]
        made = [await t._client() for t in many]
        for t in many:
            await t.close()
        assert sa.closed and sk.closed and sum(s.closed for s in made) == 2
        return made

    made = asyncio.run(main())
    assert all(s.closed for s in made)  # asyncio.run's end closed those kept


def test_the_sync_api_loop_closes_its_sessions_at_exit():
    from warmbox.sdk._sync import _LoopThread

    runner = _LoopThread()
    loop = runner.loop()
    t = HttpTransport("unix:/nonexistent/s.sock")
    session = runner.run(t._client())
    runner.run(t.close())
    assert not session.closed
    _LoopThread._finish(loop)  # what atexit runs
    assert session.closed
    loop.call_soon_threadsafe(loop.stop)
