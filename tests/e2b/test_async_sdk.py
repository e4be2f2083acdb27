"""The official E2B Python SDKs (async) against a real `warmbox serve`: a base sandbox's commands
and files, pause and connect keeping the id and the files, kill; the code interpreter's async twin."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.sandbox

e2b = pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")
from e2b import AsyncSandbox  # noqa: E402
from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox  # noqa: E402


def test_base_sandbox_commands_files_pause_connect_and_kill(e2b_server):
    async def main() -> None:
        sb = await AsyncSandbox.create(timeout=300, metadata={"lane": "e2b-async"}, envs={"FROM_CREATE": "yes"})
        try:
            assert (await sb.get_info()).template_id == "base"
            assert (await sb.commands.run("echo $FROM_CREATE")).stdout == "yes\n"
            with pytest.raises(e2b.TimeoutException):
                await sb.commands.run("sleep 30", timeout=1)
            r = await sb.commands.run("echo $((6 * 7))")
            assert r.stdout == "42\n"
            h = await sb.commands.run("read line; echo got:$line", background=True, stdin=True)
            await sb.commands.send_stdin(h.pid, "hi\n")
            assert (await h.wait()).stdout == "got:hi\n"
            events: asyncio.Queue = asyncio.Queue()
            watch = await sb.files.watch_dir("/workspace", on_event=events.put_nowait)
            await sb.files.write("/workspace/kept.txt", "kept across a pause")
            while (ev := await asyncio.wait_for(events.get(), 30)).name != "kept.txt":
                pass
            assert ev.type in (e2b.FilesystemEventType.CREATE, e2b.FilesystemEventType.WRITE)
            await watch.stop()
            assert [e.name for e in await sb.files.list("/workspace")] == ["kept.txt"]

            await sb.pause()
            listed = await AsyncSandbox.list(query=e2b.SandboxQuery(metadata={"lane": "e2b-async"})).next_items()
            assert [(s.sandbox_id, s.state) for s in listed] == [(sb.sandbox_id, "paused")]
            assert await AsyncSandbox.pause(sb.sandbox_id) is False  # already paused: E2B's 409

            again = await AsyncSandbox.connect(sb.sandbox_id, timeout=300)
            assert again.sandbox_id == sb.sandbox_id
            assert (await again.get_info()).state == "running"
            assert await again.files.read("/workspace/kept.txt") == "kept across a pause"
            assert (await again.commands.run("true")).exit_code == 0
            # a filesystem-only pause (E2B's memory: false); the default above asked for memory,
            # which the container tier answers with this same pause
            assert await again.pause(mode="filesystem")
            assert (await AsyncSandbox.get_info(sb.sandbox_id)).state == "paused"
            again = await AsyncSandbox.connect(sb.sandbox_id, timeout=300)
            assert await again.files.read("/workspace/kept.txt") == "kept across a pause"
            # the async SDK's own copies of the metrics, network and snapshot-list calls
            got = await again.get_metrics()
            assert got and all(m.mem_total > 0 and m.cpu_count >= 1 for m in got)
            await again.update_network({"allow_out": ["example.com"]})
            snaps = await AsyncSandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items()
            assert all(x.snapshot_id.startswith("snap-") for x in snaps)
        finally:
            assert await AsyncSandbox.kill(sb.sandbox_id) is True
        assert await AsyncSandbox.kill(sb.sandbox_id) is False
        with pytest.raises(e2b.NotFoundException):
            await AsyncSandbox.get_info(sb.sandbox_id)
        assert not await sb.is_running()

    asyncio.run(main())


def test_async_code_interpreter(e2b_server):
    async def main() -> None:
        sb = await AsyncCodeSandbox.create(timeout=300)
        try:
            seen: list[str] = []
            ex = await sb.run_code("for i in range(3):\n    print(i)\n'end'", on_stdout=lambda m: seen.append(m.line))
            assert ex.text == "'end'" and "".join(seen) == "0\n1\n2\n"
            ctx = await sb.create_code_context()
            await sb.run_code("y = 5", context=ctx)
            assert (await sb.run_code("y * 2", context=ctx)).text == "10"
            assert ctx.id in {c.id for c in await sb.list_code_contexts()}
            await sb.restart_code_context(ctx.id)
            ex = await sb.run_code("import os\n(os.environ['E'], 'y' in dir())", context=ctx, envs={"E": "1"})
            assert ex.text == "('1', False)", ex.error
            await sb.remove_code_context(ctx.id)
        finally:
            await sb.kill()

    asyncio.run(main())
