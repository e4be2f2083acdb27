"""The daemon SIGKILLed (or its guard, then the daemon): sandbox timeouts are still enforced.

A real container sandbox with a 5 s timeout; its home's daemon is killed by PID and the test
makes no further warmbox call. The guard restarts the daemon, which reaps the sandbox: the runc
container and its processes are gone within BOUND_S of the deadline (measured on a 2-core host:
0.2 s when the kill came seconds before the deadline, about 1 s when it came just before it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.attacks.conftest import home_procs
from tests.conftest import wait_for
from warmbox.engine import provision

pytestmark = pytest.mark.sandbox

TIMEOUT_S = 5.0
BOUND_S = 15.0  # how long past its deadline the sandbox may still exist


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def _runc_ids(runc: str, root: Path) -> list[str]:
    if not root.exists():
        return []
    r = subprocess.run(
        [runc, "--root", str(root), "list", "--format", "json"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return [c["id"] for c in json.loads(r.stdout or "null") or []]


@pytest.mark.parametrize(
    "kill, when", [("daemon", "at once"), ("guard-then-daemon", "at once"), ("daemon", "just before the deadline")]
)
def test_timeout_enforced_after_the_daemon_is_sigkilled(private_home, kill, when):
    engine = private_home
    h = engine.home

    async def create():
        got = await provision.create(engine, tier="container", timeout=TIMEOUT_S, pool=False)
        await got.session.close()
        return got.info

    info = asyncio.run(create())
    sid = info.sandbox_id
    runc = engine.backend("container").runc
    root = engine.runtime / "runc"
    state_dir = engine.runtime / "sandboxes" / sid
    init = json.loads((root / sid / "state.json").read_text())["init_process_pid"]
    assert _running(init) and sid in _runc_ids(runc, root)
    # from here on: no warmbox call, only /proc, runc and the file system
    daemon = wait_for(lambda: home_procs(h, b"warmbox.engine.daemon"), 10, "the daemon to run")
    assert len(daemon) == 1, daemon
    if kill == "guard-then-daemon":
        guard = wait_for(lambda: home_procs(h, b"--guard"), 10, "the guard to run")
        os.kill(guard[0], signal.SIGKILL)
        wait_for(lambda: (g := home_procs(h, b"--guard")) and g != guard, 10, "the daemon to start a new guard")
    if when == "just before the deadline":  # the restart's whole latency then adds to the lateness
        time.sleep(max(0.0, info.expires_at - 0.3 - time.time()))
    os.kill(daemon[0], signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: not _running(daemon[0]), 5, "the daemon to die")
    assert killed_at < info.expires_at, "the kill must come before the deadline to prove anything"

    def gone() -> bool:
        return not _running(init) and sid not in _runc_ids(runc, root) and not state_dir.exists()

    wait_for(gone, info.expires_at + BOUND_S - time.time(), f"sandbox {sid} to be destroyed after its timeout")
    late = time.time() - info.expires_at
    print(
        f"sandbox destroyed {late:.2f} s after its deadline (daemon killed {info.expires_at - killed_at:.2f} s "
        "before it)"
    )
    assert late < BOUND_S
    assert home_procs(h, b"warmbox.engine.daemon") != daemon, "a new daemon did the reaping"
    # the assertions are done: warmbox may be asked now. The runtime is gone before the teardown
    # records it (cgroups and the registry row come last), so that row is waited for, briefly
    got = wait_for(lambda: (i := engine.info(sid)[0]).state.value == "destroyed" and i, 5, "the row to say destroyed")
    assert got.state.value == "destroyed"
    assert engine.registry.sandboxes.transitions(sid)[-1].reason == "timeout expired"
