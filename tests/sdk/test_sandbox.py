"""The SDK against real sandboxes: the issue's sample, streaming, code contexts, files, errors."""

from __future__ import annotations

import asyncio
import time

import pytest

import warmbox
from tests.conftest import wait_for
from warmbox import (
    AsyncSandbox,
    InvalidArgument,
    InvalidPath,
    Limits,
    PathNotFound,
    Sandbox,
    SandboxNotFound,
    WarmboxError,
)


@pytest.mark.sandbox
def test_the_issue_sample(home, runc_ready):
    with Sandbox.create(
        tier="container", timeout=300, envs={"GREETING": "hi"}, limits=Limits(memory_mb=512, cpus=1.0, pids=256)
    ) as sb:
        r = sb.commands.run("python3 -c 'print(2 + 2)'")
        assert (r.exit_code, r.stdout) == (0, "4\n")
        sb.run_code("import math; x = 41")
        assert sb.run_code("x + 1").text == "42"
        sb.files.write("/workspace/a.txt", "data")
        assert sb.files.read("/workspace/a.txt") == "data"
        assert set(sb.timings) == {"allocation", "filesystem", "runtime", "dependencies", "first_command"}
        assert all(t.on_request_path for t in sb.stage_timings) and not sb.from_pool
        assert all(v > 0 for v in sb.timings.values())


@pytest.mark.sandbox
def test_streaming_callbacks_get_chunks_before_the_end(sb):
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = sb.commands.run("echo start; sleep 1; echo end", on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    total = time.monotonic() - t0
    assert r.stdout == "start\nend\n"
    assert seen[0][1] == "start\n" and seen[0][0] < total - 0.5


@pytest.mark.sandbox
def test_timeout_kills_tree_quickly(sb):
    t0 = time.monotonic()
    r = sb.commands.run("sleep 1000 & sleep 1000 & sleep 1000; wait", timeout=1)
    assert r.timed_out and time.monotonic() - t0 < 4
    assert sb.commands.run("ps -eo comm | grep -c sleep || true").stdout.strip() == "0"


@pytest.mark.sandbox
def test_output_flood_is_truncated(sb):
    r = sb.commands.run("yes | head -c 50000000", max_output=1_000_000)
    assert r.truncated and len(r.stdout) == 1_000_000 and r.exit_code == 0


@pytest.mark.sandbox
def test_stdin_cwd_argv_envs(sb):
    assert sb.commands.run(["cat"], stdin="piped").stdout == "piped"
    sb.files.make_dir("/workspace/sub")
    assert sb.commands.run("pwd", cwd="sub").stdout == "/workspace/sub\n"
    assert sb.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"
    r = sb.commands.run(["sh", "-c", "exit 4"])
    assert r.exit_code == 4 and not r.ok
    with pytest.raises(warmbox.CommandFailed):
        sb.commands.run("false", check=True)


@pytest.mark.sandbox
def test_run_code_rich_outputs_errors_and_contexts(sb):
    e = sb.run_code("print('out'); import sys; print('err', file=sys.stderr); 6 * 7")
    assert (e.text, e.stdout, e.stderr, e.error) == ("42", "out\n", "err\n", None)
    e = sb.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})\ndf")
    main = e.results[0]
    assert main.is_main_result and "<table" in (main.html or "") and "a" in main.text
    e = sb.run_code("raise ValueError('bad')")
    assert e.error.name == "ValueError" and e.error.value == "bad" and "ValueError" in e.error.traceback
    ctx = sb.create_code_context()
    sb.run_code("y = 1", context=ctx)
    assert sb.run_code("y", context=ctx).text == "1"
    assert sb.run_code("'y' in globals()").text == "False"  # default context is separate
    e = sb.run_code("while True: pass", context=ctx, timeout=1)
    assert e.timed_out and e.error.name == "KeyboardInterrupt"
    assert sb.run_code("y", context=ctx).text == "1"
    sb.remove_code_context(ctx)
    with pytest.raises(warmbox.ContextError):
        sb.run_code("y", context=ctx)


@pytest.mark.sandbox
def test_files_api(sb):
    blob = bytes(range(256)) * 8192  # 2 MiB, several chunks
    info = sb.files.write("data/blob.bin", blob)
    assert info.path == "/workspace/data/blob.bin" and info.size == len(blob)
    assert sb.files.read("/workspace/data/blob.bin", format="bytes") == blob
    names = {e.name for e in sb.files.list("/workspace/data")}
    assert names == {"blob.bin"}
    assert sb.files.exists("data/blob.bin") and not sb.files.exists("nope")
    assert sb.files.make_dir("/workspace/x/y") and not sb.files.make_dir("/workspace/x/y")
    sb.files.remove("/workspace/data")
    with pytest.raises(PathNotFound):
        sb.files.read("/workspace/data/blob.bin")
    with pytest.raises(warmbox.PathPermissionDenied):
        sb.files.write("/etc/passwd", "root::0:0::/:/bin/sh")
    with pytest.raises(warmbox.IsADirectory):
        sb.files.read("/workspace")


@pytest.mark.sandbox
@pytest.mark.parametrize("path", ["", "a\0b", "../etc/passwd", "/workspace/../../etc", "x" * 5000, 42])
def test_bad_paths_are_typed_errors(sb, path):
    with pytest.raises(InvalidPath):
        sb.files.read(path)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tier": "bogus"}, "unknown tier"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"envs": {"1BAD": "x"}}, "not valid"),
        ({"envs": {"A": 1}}, "string"),
        ({"limits": {"memory_mb": 5}}, "Limits"),
    ],
)
def test_bad_create_arguments(home, kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Sandbox.create(**kwargs)


def test_bad_limits_and_unavailable_tier():
    with pytest.raises(InvalidArgument):
        Limits(memory_mb=-1)
    with pytest.raises(InvalidArgument):
        Limits(cpus=0)
    with pytest.raises(InvalidArgument, match="unknown tier"):
        Sandbox.create(tier="v9")


@pytest.mark.sandbox
def test_dead_and_unknown_ids(home, runc_ready):
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sb-000000000000")
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("../../etc")
    sb = Sandbox.create(timeout=60)
    sid = sb.sandbox_id
    assert sb.kill() is True
    with pytest.raises(SandboxNotFound):
        sb.commands.run("true")
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sid)
    assert isinstance(SandboxNotFound("x"), WarmboxError)


@pytest.mark.sandbox
def test_reconnect_from_another_object_keeps_state(home, runc_ready):
    with Sandbox.create(timeout=60) as a:
        a.files.write("f", "kept")
        a.run_code("z = 5")

        def recorded() -> Sandbox | None:
            # the first command's timing is sent off the caller's path (over HTTP or through a
            # cluster's router it can land after a connect made at once): a connect sees it then
            got = Sandbox.connect(a.sandbox_id)
            return got if "first_command" in got.timings else None

        b = wait_for(recorded, 30, "the first command's timing to be recorded", 0.05)
        assert b.files.read("f") == "kept" and b.run_code("z").text == "5"
        assert b.timings == a.timings


@pytest.mark.sandbox
def test_async_twin(home, runc_ready):
    async def go():
        async with await AsyncSandbox.create(timeout=60) as sb:
            results = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(10)))
            return [r.stdout.strip() for r in results]

    assert asyncio.run(go()) == [str(i) for i in range(10)]


@pytest.mark.sandbox
def test_hostile_sized_inputs_are_typed_or_handled(sb):
    # argv bytes that are not UTF-8 (surrogate-escaped by Python) reach the sandbox intact
    r = sb.commands.run(["printf", "%s", "caf\udce9"])
    assert r.exit_code == 0 and r.stdout == "caf\ufffd"
    # a request beyond the protocol's frame size is a typed error, not a traceback
    with pytest.raises(InvalidArgument, match="too large"):
        sb.run_code("x = 1\n" * 300_000)
    # more output in one write than one frame carries is chunked, not lost
    e = sb.run_code("print('x' * 5_000_000)")
    assert e.error is None and len(e.stdout) == 5_000_001
    e = sb.run_code("raise ValueError('\\udc80' * 10 + 'y' * 200_000)")
    assert e.error.name == "ValueError" and len(e.error.value) < 70_000
    assert sb.run_code("1 + 1").text == "2"  # the context survived
