"""Tier 3 (gVisor): the same SDK calls, a user-space kernel underneath, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time

import pytest

from tests.backends.conftest import NOTHING, leftovers, recording
from warmbox import Limits, Sandbox, State
from warmbox.engine.engine import Engine
from warmbox.engine.guest_client import GuestClient
from warmbox.errors import GuestConnectionError
from warmbox.guest import userenv


@pytest.fixture(scope="module")
def gv(home, runc_ready):
    engine = Engine.for_home(home)
    avail = engine.backend("gvisor").probe()
    if not avail.available:
        pytest.fail(f"the gvisor tier must run here (scripts/bootstrap installs runsc and gcc): {avail.reason}")
    with Sandbox.create("gvisor", timeout=600, envs={"GREETING": "hi"}) as sb:
        yield sb


@pytest.mark.sandbox
def test_the_kernel_is_gvisor_not_the_hosts(gv):
    r = gv.commands.run("uname -r; dmesg | head -1")
    release, first = r.stdout.splitlines()[:2]
    assert release != os.uname().release and "gVisor" in first
    assert gv.tier == "gvisor"


@pytest.mark.sandbox
def test_same_user_env_and_tools_as_tier2(gv):
    assert gv.commands.run("id -u").stdout.strip() == "1000"
    env = dict(line.split("=", 1) for line in gv.commands.run(["/usr/bin/env"]).stdout.splitlines() if "=" in line)
    image = {"VIRTUAL_ENV", "npm_config_prefix", *userenv.OFFLINE_ENV}  # the image's own (guest/userenv.py)
    assert set(env) == {"PATH", "HOME", "LANG", "GREETING", *image} and env["GREETING"] == "hi"
    # coreutils' statx works (the image's shim) — ls, stat, cp, mv, find, du
    r = gv.commands.run(
        "cd /workspace && echo x > a && cp a b && mv b c && stat -c %s c && ls && "
        "find . -name c && du -s . > /dev/null && echo ok"
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["2", "a", "c", "./c", "ok"]
    # the image's own /etc/shadow (no host secret in it) is not the sandbox user's to read
    assert gv.commands.run("cat /etc/shadow > /dev/null 2>&1 || echo unreadable").stdout.strip() == "unreadable"


@pytest.mark.sandbox
def test_files_code_contexts_and_timeouts(gv):
    gv.files.write("/workspace/data.txt", "via gofer")
    assert gv.files.read("/workspace/data.txt") == "via gofer"
    gv.run_code("import math; x = 41")
    assert gv.run_code("x + 1").text == "42"
    t0 = time.monotonic()
    r = gv.commands.run("sleep 1000 & sleep 1000", timeout=1)
    assert r.timed_out and time.monotonic() - t0 < 10
    assert gv.commands.run("pgrep -c sleep || true").stdout.strip() in ("0", "")


@pytest.mark.sandbox
def test_loopback_only(gv):
    r = gv.commands.run(["python3", "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"])
    assert r.stdout.strip() == "['lo']"


@pytest.mark.sandbox
def test_snapshot_and_fork_work_on_gvisor(gv):
    gv.files.write("/workspace/snap.txt", "gvisor files")
    gv.run_code("kept = [1, 2, 3]")
    ref = gv.snapshot()
    assert ref.tier == "gvisor" and ref.memory is False
    with Sandbox.create(from_snapshot=ref, timeout=120) as fork:
        assert fork.tier == "gvisor"
        assert fork.files.read("/workspace/snap.txt") == "gvisor files"
        assert fork.run_code("kept").text == "[1, 2, 3]"


@pytest.mark.sandbox
def test_kill_leaves_nothing(home, runc_ready, monkeypatch):
    """Nothing of the sandbox is left, and runsc was not asked to delete it (it would wait until the
    host's init had reaped the Sentry and the gofer: seconds here); a second teardown is harmless."""
    from warmbox.backends import _host as host

    engine = Engine.for_home(home)
    backend = engine.backend("gvisor")
    calls = recording(backend, monkeypatch)
    sb = Sandbox.create("gvisor", timeout=60, template="shell")
    sb.commands.run("sleep 1000 > /dev/null 2>&1 &")
    _, handle = engine.info(sb.sandbox_id)
    pids = backend._pids(sb.sandbox_id)
    assert len(pids) >= 2  # the Sentry, the gofer (and the ptrace platform's stubs)
    sb.kill()
    assert engine.info(sb.sandbox_id)[0].state is State.DESTROYED
    assert not [p for p in pids if host.running(p)]
    assert leftovers(backend, handle) == NOTHING and calls == []
    out = subprocess.run([backend.runsc, "--root", str(backend.root), "list", "-quiet"], capture_output=True, text=True)
    assert sb.sandbox_id not in out.stdout
    asyncio.run(backend.destroy(handle))
    assert leftovers(backend, handle) == NOTHING and calls == []


@pytest.mark.sandbox
def test_memory_limit_contains_a_bomb(home, runc_ready):
    """The cgroup limit holds. Under gVisor it applies to the whole Sentry, so an OOM there ends the
    sandbox (a typed error on the next call), where Tier 2 kills only the offending process."""
    from warmbox.errors import SandboxError

    engine = Engine.for_home(home)
    sb = Sandbox.create("gvisor", timeout=60, template="shell", limits=Limits(memory_mb=256))
    try:
        try:
            r = sb.commands.run(["python3", "-c", "x = b'a' * (2 << 30); print('survived')"], timeout=60)
            assert "survived" not in r.stdout and r.exit_code != 0
            alive = sb.commands.run("echo alive", timeout=60).stdout == "alive\n"
        except SandboxError:
            alive = False
        peak = engine.registry.meter(sb.sandbox_id)
        assert peak is None or peak.peak_bytes <= 256 << 20
        if not alive:
            with pytest.raises(SandboxError):
                sb.commands.run("true")
    finally:
        sb.kill()
    assert not [d for d in engine.backend("gvisor").cgroup_dirs(sb.sandbox_id) if d.exists()]


def test_the_host_never_follows_a_planted_symlink(tmp_path):
    real = tmp_path / "real.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(real))
    srv.listen(1)
    link = tmp_path / "agent.sock"
    link.symlink_to(real)
    try:
        with pytest.raises(GuestConnectionError, match="not a socket"):
            asyncio.run(GuestClient.connect(str(link), "sb-test"))
    finally:
        srv.close()


@pytest.mark.sandbox
def test_memory_pause_and_resume_continue_execution(home, runc_ready):
    """A variable, a background process's counter and an open file all carry on after resume."""
    engine = Engine.for_home(home)
    sb = Sandbox.create("gvisor", timeout=120, template="base")
    sb.run_code("log = open('/tmp/log.txt', 'w')\nlog.write('before\\n')\nlog.flush()\ncounter = 41")
    sb.commands.run(
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/bg.new; mv /tmp/bg.new /tmp/bg; "  # never empty
        "sleep 0.05; done) >/dev/null 2>&1 &"
    )
    time.sleep(0.5)
    ref = sb.pause(memory=True)
    assert ref.memory and ref.tier == "gvisor" and ref.size_bytes > 0
    assert engine.info(sb.sandbox_id)[0].state is State.PAUSED
    assert not [d for d in engine.backend("gvisor").cgroup_dirs(sb.sandbox_id) if d.exists()]
    with Sandbox.resume(sb.sandbox_id, timeout=120) as back:
        assert back.run_code("counter + 1").text == "42"
        back.run_code("log.write('after\\n'); log.flush()")  # the same open file object
        assert back.files.read("/tmp/log.txt") == "before\nafter\n"
        first = int(back.commands.run("cat /tmp/bg").stdout)
        time.sleep(0.5)
        assert int(back.commands.run("cat /tmp/bg").stdout) > first  # the loop kept running
    assert engine.info(sb.sandbox_id)[0].state is State.DESTROYED


@pytest.mark.sandbox
def test_memory_snapshot_of_a_running_sandbox_is_refused_typed(gv):
    from warmbox import SnapshotUnsupported

    with pytest.raises(SnapshotUnsupported, match="pause"):
        gv.snapshot(memory=True)
    assert gv.commands.run("true").exit_code == 0


@pytest.mark.sandbox
def test_gvisor_pools_hold_sandboxes_restored_from_a_template_snapshot(home, runc_ready):
    from tests.conftest import set_config, wait_for

    engine = Engine.for_home(home)
    set_config(
        home,
        """
[templates.t-rand]
warmup_code = "import random"

[pools.t-gv]
tier = "gvisor"
template = "t-rand"
min = 2
max = 2
target = 2
limits = { memory_mb = 444 }
""",
    )
    try:
        engine.ensure_daemon()
        wait_for(lambda: engine.registry.pool_counts("t-gv")[0] >= 2, 180, "the gvisor pool to fill")
        from warmbox.config import shape_key

        image = engine.image_for("t-rand").image_id  # the shape names the image its sandboxes run
        shape = shape_key("gvisor", engine.settings().template("t-rand"), Limits(memory_mb=444), image)
        template = {
            v
            for k, v in engine.registry._db.execute("SELECT key, value FROM meta_text")
            if k.startswith(f"template:{shape}")
        }  # other tests' templates live in the same home
        assert len(template) == 1  # one checkpoint of the warmed template, restored twice
        snap = next(iter(template))
        for sid in engine.registry.pooled("t-gv"):
            assert [t.reason for t in engine.registry.transitions(sid)][-1] == f"restored from {snap}"
        with Sandbox.create("gvisor", template="t-rand", limits=Limits(memory_mb=444), envs={"WHO": "me"}) as sb:
            assert sb.from_pool and sb.tier == "gvisor"
            r = sb.run_code("import os; os.environ['WHO'], 2 + 2")
            assert r.text == "('me', 4)" and r.execution_count == 1
            assert sb.commands.run("echo $WHO; uname -r").stdout.split()[0] == "me"
            draw = "import random; random.random()"  # the module the template's warm-up imported
            with Sandbox.create("gvisor", template="t-rand", limits=Limits(memory_mb=444)) as sb2:  # the other restore
                assert sb2.from_pool
                a, b = sb.run_code(draw).text, sb2.run_code(draw).text
                assert a != b  # both restored the template's generator state: reseeded per restore
    finally:
        set_config(home)
    wait_for(lambda: not engine.registry.pooled("t-gv"), 60, "the gvisor pool to be retired")
