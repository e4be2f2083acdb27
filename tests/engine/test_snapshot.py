"""Snapshots on the container tier: files + code-context state, pause/resume/fork, faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli
from warmbox import ArtifactCorrupt, Sandbox, SnapshotUnsupported, State, StorageFull
from warmbox.engine import duties, snapstore
from warmbox.engine import snapshot as snaps
from warmbox.engine.engine import Engine
from warmbox.storage import snapshots as artifacts

pytestmark = pytest.mark.sandbox

TURN1 = """
import json, sys
from warmbox import Sandbox
sb = Sandbox.create(template="pydata", timeout=300)
sb.files.write("/workspace/repo/notes.md", "turn 1 was here")
sb.commands.run("echo scratch > /tmp/scratch && echo rc > /home/user/.rc")
r = sb.run_code("import pandas\\ndf = pandas.DataFrame({'a': range(7), 'b': range(7), 'c': range(7)})"
                "\\nseen = {'turn': 1}")
assert r.error is None, r.error
ref = sb.pause()
print(json.dumps({"sandbox_id": sb.sandbox_id, "snapshot_id": ref.snapshot_id}))
"""

TURN2 = """
import json, sys
from warmbox import Sandbox
sb = Sandbox.resume(sys.argv[1], timeout=300)
out = {
  "shape": sb.run_code("df.shape").text,
  "seen": sb.run_code("seen").text,
  "notes": sb.files.read("/workspace/repo/notes.md"),
  "tmp": sb.commands.run("cat /tmp/scratch /home/user/.rc").stdout,
  "id": sb.sandbox_id,
}
sb.kill()
print(json.dumps(out))
"""


def _py(code: str, *args: str, timeout: float = 300) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _procs_of(engine: Engine, sandbox_id: str) -> list[int]:
    return engine.backend("container")._pids(sandbox_id)


def test_multi_turn_across_pause_and_resume_in_new_processes(home, runc_ready):
    engine = Engine.for_home(home)
    t1 = _py(TURN1)
    info, handle = engine.info(t1["sandbox_id"])
    assert info.state is State.PAUSED
    # paused: no process, cgroup or sandbox directory is left, only the artifact
    assert not _procs_of(engine, info.sandbox_id)
    assert not [d for d in engine.backend("container").cgroup_dirs(info.sandbox_id) if d.exists()]
    assert not Path(handle.state_dir).exists()
    t2 = _py(TURN2, t1["sandbox_id"])
    assert t2["shape"] == "(7, 3)" and t2["seen"] == "{'turn': 1}"
    assert t2["notes"] == "turn 1 was here" and t2["tmp"] == "scratch\nrc\n"
    assert t2["id"] == t1["sandbox_id"]  # one id for its whole life
    assert engine.info(t1["sandbox_id"])[0].state is State.DESTROYED  # killed at the end of turn 2
    assert engine.registry.sandboxes.parent(t2["id"]) == t1["snapshot_id"]


def test_fork_two_sandboxes_from_one_snapshot_diverge(home, runc_ready):
    with Sandbox.create(timeout=120) as origin:
        origin.files.write("shared.txt", "v0")
        origin.run_code("counter = 10")
        ref = origin.snapshot()  # origin keeps running
        assert origin.run_code("counter").text == "10"
        with Sandbox.create(from_snapshot=ref, timeout=120) as a, Sandbox.create(from_snapshot=ref.snapshot_id) as b:
            a.run_code("counter += 1")
            a.files.write("shared.txt", "a")
            b.run_code("counter -= 1")
            assert (a.run_code("counter").text, b.run_code("counter").text) == ("11", "9")
            assert (a.files.read("shared.txt"), b.files.read("shared.txt"), origin.files.read("shared.txt")) == (
                "a",
                "v0",
                "v0",
            )
            assert len({a.sandbox_id, b.sandbox_id, origin.sandbox_id}) == 3


def test_memory_snapshots_are_refused_with_a_typed_error_on_this_tier(home, runc_ready):
    with Sandbox.create(timeout=60, template="shell") as sb:
        with pytest.raises(SnapshotUnsupported, match="cannot snapshot memory"):
            sb.snapshot(memory=True)
        assert sb.commands.run("true").exit_code == 0
    caps = Engine.for_home(home).backend("container").capabilities()
    assert caps.memory_snapshot is False and caps.filesystem_snapshot is True


def test_corrupt_or_truncated_artifacts_are_typed_and_restore_nothing(home, runc_ready):
    engine = Engine.for_home(home)
    with Sandbox.create(timeout=60, template="shell") as sb:
        sb.commands.run("head -c 200000 /dev/urandom > /workspace/blob")
        ref = sb.snapshot()
    m = snaps.resolve(engine, ref.snapshot_id)
    blob = engine.home / "objects" / artifacts.blob_key(m.filesystem_sha256)
    data = blob.read_bytes()
    before = {i.sandbox_id for i in engine.list(include_dead=True)}
    try:
        blob.write_bytes(data[: len(data) // 2])  # truncated
        with pytest.raises(ArtifactCorrupt, match="truncated"):
            Sandbox.create(from_snapshot=ref)
        blob.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, flipped bits
        with pytest.raises(ArtifactCorrupt, match="checksum"):
            Sandbox.create(from_snapshot=ref)
        manifest = engine.home / "objects" / artifacts.manifest_key(ref.snapshot_id)
        good = manifest.read_text()
        manifest.write_text(good[:40])
        r = cli("resume", ref.snapshot_id)
        assert r.returncode == 125 and "manifest is not valid" in r.stderr and "Traceback" not in r.stderr
        manifest.write_text(good)
    finally:
        blob.write_bytes(data)
    assert {i.sandbox_id for i in engine.list(include_dead=True)} == before  # no half-restored sandbox


@pytest.mark.parametrize("where", ["object store", "host temp dir"])
def test_disk_full_during_pause_is_typed_and_the_sandbox_keeps_running(home, runc_ready, tmp_path, where):
    mnt = tmp_path / "tiny" if where == "object store" else home / "tmp"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], check=True)
    old = os.environ.get("WARMBOX_OBJECT_STORE")
    if where == "object store":
        os.environ["WARMBOX_OBJECT_STORE"] = str(mnt)
    try:
        with Sandbox.create(timeout=60, template="shell") as sb:
            sb.commands.run("head -c 2000000 /dev/urandom > /workspace/big")
            with pytest.raises(StorageFull):
                sb.pause()
            assert sb.get_info().state is State.READY
            assert sb.commands.run("stat -c %s /workspace/big").stdout.strip() == "2000000"
            assert not [p for p in mnt.rglob("*") if p.is_file()]  # nothing half-written is left
            assert sb.commands.run("ls -A /tmp").stdout == ""  # nor the context pickle
    finally:
        if old is None:
            os.environ.pop("WARMBOX_OBJECT_STORE", None)
        else:
            os.environ["WARMBOX_OBJECT_STORE"] = old
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_pause_killed_midway_leaves_the_sandbox_running_or_fully_snapshotted(home, runc_ready):
    engine = Engine.for_home(home)
    sb = Sandbox.create(timeout=120, template="shell")
    sb.commands.run("head -c 30000000 /dev/urandom > /workspace/big && echo ok > /workspace/small")
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmbox.cli.main", "pause", sb.sandbox_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    info, _ = engine.info(sb.sandbox_id)
    try:
        if info.state is State.PAUSED:
            # killed while releasing, perhaps: the pauser is dead, so a reap finishes the release
            import asyncio

            asyncio.run(duties.reap(engine))
            assert not Path(engine.info(sb.sandbox_id)[1].state_dir).exists()
            with Sandbox.resume(sb.sandbox_id, timeout=60) as back:
                assert back.files.read("/workspace/small") == "ok\n"
        else:
            assert info.state is State.READY
            assert sb.files.read("/workspace/small") == "ok\n"  # still running, nothing lost
            ids = engine.registry.snapshots.snapshots_of(sb.sandbox_id)
            for sid in ids:  # a recorded snapshot is always complete
                snaps.resolve(engine, sid)
    finally:
        if engine.info(sb.sandbox_id)[0].state is not State.DESTROYED:
            sb.kill()


def test_manifests_and_artifacts_carry_no_env_values(home, runc_ready, tmp_path):
    engine = Engine.for_home(home)
    secret = "sk-test-" + os.urandom(8).hex()
    with Sandbox.create(timeout=60, envs={"OPENAI_API_KEY": secret}) as sb:
        sb.run_code("import os; k = len(os.environ['OPENAI_API_KEY'])")
        ref = sb.snapshot()
    m = snaps.resolve(engine, ref.snapshot_id)
    assert m.env_names == ("OPENAI_API_KEY",)
    manifest = (engine.home / "objects" / artifacts.manifest_key(ref.snapshot_id)).read_text()
    assert secret not in manifest
    raw = tmp_path / "raw.tar"
    artifacts.get_blob(
        snapstore.store_for(engine), m.filesystem_sha256, m.filesystem_bytes, m.filesystem_raw_bytes, raw, tmp_path
    )
    assert secret.encode() not in raw.read_bytes()


def test_snapshot_cli_and_garbage_collection(home, runc_ready):
    engine = Engine.for_home(home)
    with Sandbox.create(timeout=60, template="shell") as sb:
        sb.files.write("f", "x" * 5000)
        r = cli("snapshot", sb.sandbox_id, "--json")
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert snap["memory"] is False and snap["sandbox_id"] == sb.sandbox_id
    r = cli("snapshots", "ls", "--json")
    assert snap["snapshot_id"] in {s["snapshot_id"] for s in json.loads(r.stdout)}
    r = cli("resume", snap["snapshot_id"], "--json")
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)["sandbox_id"]
    with Sandbox.connect(new) as back:
        assert back.files.read("f") == "x" * 5000
    sha = snaps.resolve(engine, snap["snapshot_id"]).filesystem_sha256  # the manifest's blob
    blob = artifacts.blob_key(sha)
    store = snapstore.store_for(engine)
    assert cli("snapshots", "rm", snap["snapshot_id"]).returncode == 0
    still_used = any(
        snaps.resolve(engine, s).filesystem_sha256 == sha for s, *_ in engine.registry.snapshots.all_snapshots()
    )
    assert cli("snapshots", "gc", "--now").returncode == 0
    assert store.exists(blob) == still_used
    r = cli("resume", "snap-nope")
    assert r.returncode == 125 and "Traceback" not in r.stderr
