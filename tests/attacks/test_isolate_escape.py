"""Tier 1 attacks: JavaScript reaching for the host, CPU and memory exhaustion, and the jail an engine
escape would land in (the host process's own credentials, seen from the host's /proc)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmbox import Limits, Sandbox
from warmbox.backends.isolate import HOST_UID, IsolateBackend
from warmbox.engine.engine import Engine
from warmbox.storage.uidslots import LEDGER_DIR, UidLedger, slot_of_uid, uid_base

pytestmark = pytest.mark.sandbox

HOST_APIS = (
    "require",
    "process",
    "module",
    "global",
    "fetch",
    "XMLHttpRequest",
    "WebSocket",
    "Deno",
    "Bun",
    "importScripts",
    "setTimeout",
    "Buffer",
)


@pytest.fixture(scope="module")
def iso_host(home, runc_ready):
    backend = Engine.for_home(home).backend("isolate")
    assert isinstance(backend, IsolateBackend)
    avail = backend.probe()
    if not avail.available:
        pytest.fail(f"the isolate tier must run here (scripts/bootstrap install builds it): {avail.reason}")
    yield backend
    backend.stop_host()
    assert backend.host_pid() is None


@pytest.fixture(scope="module")
def box(iso_host):
    with Sandbox.create(tier="isolate", timeout=600) as sb:
        yield sb


def js(sb: Sandbox, code: str, **kw):
    return sb.run_code(code, language="javascript", **kw)


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def test_javascript_has_no_host_api_and_no_module_loader(box):
    probe = " + ' ' + ".join(f"typeof {name}" for name in HOST_APIS)
    assert js(box, probe).text == "'" + " ".join(["undefined"] * len(HOST_APIS)) + "'"
    # the Function constructor reaches this isolate's own global, nothing more
    assert js(box, "Function('return this')() === globalThis").text == "true"
    e = js(box, "Function('return process')()")
    assert e.error is not None and e.error.name == "ReferenceError"
    assert js(box, "(async function () {}).constructor('return typeof require')").error is None
    # dynamic import: no module loader in an isolate, so the promise is rejected
    js(
        box,
        "var imported = 'pending'; import('fs').then(() => { imported = 'loaded' }, (e) => { imported = 'refused' })",
    )
    assert js(box, "imported").text == "'refused'"
    static = js(box, "import fs from 'fs'")
    assert static.error is not None and static.error.name == "SyntaxError"


def test_a_tight_loop_is_ended_by_the_engine_and_the_sandbox_keeps_its_state(box, iso_host):
    js(box, "var kept = 7")
    pid = iso_host.host_pid()
    for code in ("while (true) {}", "for (;;) { Math.random() }", "(function f() { while (true) f.call() })()"):
        e = js(box, code, timeout=0.5)
        assert e.timed_out or (e.error is not None and e.error.name == "RangeError"), (code, e)
    blocked = js(box, "Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0)", timeout=0.5)
    assert blocked.timed_out or blocked.error is not None
    assert js(box, "kept").text == "7"
    assert iso_host.host_pid() == pid


def test_huge_allocations_are_oom_killed_and_the_host_and_other_sandboxes_survive(box, iso_host):
    js(box, "var neighbour = 'still here'")
    pid = iso_host.host_pid()
    greedy = Sandbox.create(tier="isolate", timeout=600, limits=Limits(memory_mb=64))
    try:
        heap = js(greedy, "const a = []; while (true) a.push(new Array(1e6).fill(1.5))", timeout=60)
        assert heap.oom_killed and heap.error is not None and heap.error.name == "MemoryLimitError"
        strings = js(greedy, "let s = 'x'; while (true) s = s + s", timeout=60)
        assert strings.error is not None or strings.oom_killed
        # ArrayBuffers and Wasm memories live outside V8's heap; the limit covers them too
        buffers = js(greedy, "const bufs = []; while (true) bufs.push(new Uint8Array(64 << 20).fill(1))", timeout=60)
        assert buffers.error is not None or buffers.oom_killed
        wasm = js(greedy, "new WebAssembly.Memory({initial: 1, maximum: 65536}).grow(60000)", timeout=60)
        assert wasm.error is not None or wasm.oom_killed
        assert js(greedy, "1 + 1").text == "2"  # a fresh isolate took the disposed one's place
        assert js(box, "neighbour").text == "'still here'"
        assert iso_host.host_pid() == pid
        rss_mb = int(status(pid)["VmRSS"].split()[0]) >> 10
        assert rss_mb < 1024, f"the host holds {rss_mb} MiB after the attacks"
    finally:
        greedy.kill()


def test_the_host_process_is_jailed(box, iso_host):
    """What a V8 escape would get: the host process's own credentials, namespaces and filesystem."""
    pid = iso_host.host_pid()
    assert pid is not None
    st = status(pid)
    assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000"
    assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1"
    # uid 1000 of a range of the host-wide uid ledger, recorded as this host's (no other home or
    # tenant runs as it)
    uid = int(st["Uid"].split()[0])
    assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
    slot = slot_of_uid(uid - HOST_UID)
    assert slot is not None and uid_base(slot) == uid - HOST_UID
    entry = UidLedger(LEDGER_DIR).holder(slot)
    assert entry and entry["sandbox_id"] == iso_host.host("").holder
    for ns in ("net", "mnt", "pid", "user", "ipc", "uts", "cgroup"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    # its own cgroup, with a memory bound
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    assert iso_host.host("").id in cgroup
    # its network namespace holds a loopback only, down
    net = Path(f"/proc/{pid}/net/dev").read_text()
    assert [line.split(":")[0].strip() for line in net.splitlines()[2:]] == ["lo"]
    # its root: the engine, the host script and /usr, read-only; no host home, no warmbox state
    root = f"/proc/{pid}/root"
    for host_only in ("work", "var/lib/warmbox", "root/.pyenv", "home/user/.bashrc"):
        assert not os.path.exists(f"{root}/{host_only}"), host_only
    assert sorted(os.listdir(f"{root}/opt")) >= ["isolate-host", "isolated-vm"]
    mounts = Path(f"/proc/{pid}/mounts").read_text().splitlines()
    root_mount = next(m.split() for m in mounts if m.split()[1] == "/")
    assert "ro" in root_mount[3].split(",")


def test_wasm_has_no_files_and_is_bounded_in_time_and_memory(box, iso_host):
    pid = iso_host.host_pid()
    # WASI without a preopened directory: fd 3 (the first preopen) does not exist, so no path opens
    prestat = box.run_code(
        '(module (import "wasi_snapshot_preview1" "fd_prestat_get" (func $p (param i32 i32) (result i32)))'
        ' (memory (export "memory") 1) (func (export "main") (result i32) (call $p (i32.const 3) (i32.const 0))))',
        language="wasm",
    )
    assert prestat.text == "8"  # EBADF
    loop = box.run_code('(module (func (export "main") (loop $l (br $l))))', language="wasm", timeout=0.5)
    assert loop.timed_out
    huge = box.run_code('(module (memory (export "memory") 30000))', language="wasm")  # ~1.9 GiB
    assert huge.oom_killed and huge.error is not None and huge.error.name == "MemoryLimitError"
    grow = box.run_code(
        '(module (memory (export "memory") 1) (func (export "main") (result i32) (memory.grow (i32.const 30000))))',
        language="wasm",
    )
    assert grow.text == "-1"  # a grow past the cap is refused to the module
    assert box.run_code('(module (func (export "main") (result i32) i32.const 7))', language="wasm").text == "7"
    assert iso_host.host_pid() == pid
