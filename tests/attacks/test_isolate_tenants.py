"""Tier 1 across tenants: one tenant's isolates cannot end or stall another tenant's (through a real
`warmbox serve` with two tenant keys).

Red-team finding (issue 31): every isolate of a home lived in one Node.js host. A tenant asking for
memory_mb=7000 and filling it OOM-killed the host; three `while(true){}` made the host miss its
control answers, so the engine deleted it (or an EPIPE without a handler ended it); either way
every tenant's isolates were gone, and their rows still said `ready`. Now each tenant has a host
of its own (own cgroup with a CPU quota, own uid range from the host-wide ledger), memory is
admitted before use (LimitTooHigh), a watchdog ends a spinning isolate at its timeout, a dead
host's sandboxes are `lost` at once, and a host ends on SIGTERM and with its home.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import start_server, wait_for
from warmbox import Limits, Sandbox
from warmbox.backends import _host as host
from warmbox.backends.isolate import (
    HOST_BUDGET_MB,
    HOST_IDLE_S,
    HOST_UID,
    ISOLATE_OVERHEAD_MB,
    MACHINE_SHARE,
    IsolateBackend,
    machine_memory_mb,
)
from warmbox.engine.engine import Engine
from warmbox.errors import LimitTooHigh, SandboxLost
from warmbox.models import State
from warmbox.storage.uidslots import LEDGER_DIR, UidLedger, slot_of_uid

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

SPIN_S = 6.0  # A's spinning runs' timeout
# B's `2+2` while A spins 3 isolates and a Wasm loop: measured on this shared 2-core host 14 ms
# median, 86 ms at most (2.4 ms before the spin); the bound leaves room for other processes' load
STALL_BOUND_S = 1.0
WATCHDOG_S = 2.0 + 2.0  # a spinning run ends by its timeout + the host's watchdog (+ slack for load)
WASM_LOOP = '(module (func (export "main") (loop $l (br $l))))'
GETTER_SPIN = "({get x() { while (true) {} }})"
WASM_ANSWER = '(module (func (export "main") (result i32) i32.const 42))'


class Tenants:
    """Two tenants' keys on one real server; their sandboxes are killed after the module."""

    def __init__(
        self, url: str, names: dict[str, str], keys: dict[str, str], backend: IsolateBackend, engine: Engine
    ) -> None:
        self.url = url
        self.names = names
        self.keys = keys
        self.backend = backend
        self.engine = engine
        self.made: list[Sandbox] = []

    def create(self, who: str, memory_mb: int = 64) -> Sandbox:
        sb = Sandbox.create(
            tier="isolate",
            timeout=180,
            pool=False,
            limits=Limits(memory_mb=memory_mb),
            api_url=self.url,
            api_key=self.keys[who],
        )
        self.made.append(sb)
        return sb

    def host_pid(self, who: str) -> int | None:
        return self.backend.host_pid(self.name(who))

    def name(self, who: str) -> str:
        return self.names[who]


@pytest.fixture(scope="module")
def tenants(home: Path, runc_ready: None):
    engine = Engine.for_home(home)
    backend = engine.backend("isolate")
    assert isinstance(backend, IsolateBackend)
    avail = backend.probe()
    if not avail.available:
        pytest.fail(f"the isolate tier must run here (scripts/bootstrap install builds it): {avail.reason}")
    stamp = secrets.token_hex(3)
    names = {"a": f"iso-a-{stamp}", "b": f"iso-b-{stamp}"}
    keys = {who: engine.registry.tenants.create_key(name)[1] for who, name in names.items()}
    srv = start_server(home, home / f"iso-{stamp}.sock")
    t = Tenants(srv.url, names, keys, backend, engine)
    try:
        yield t
    finally:
        for sb in t.made:
            try:
                sb.kill()
            except Exception:
                pass
        srv.stop()
        for name in names.values():
            backend.end_host(name)
        assert all(backend.host_pid(n) is None for n in names.values())


def test_each_tenant_has_a_host_of_its_own_with_its_own_cgroup_and_ledger_uids(tenants):
    a, b = tenants.create("a"), tenants.create("b")
    assert a.run_code("1 + 1", language="javascript").text == "2"
    assert b.run_code("2 + 2", language="javascript").text == "4"
    pa, pb = tenants.host_pid("a"), tenants.host_pid("b")
    assert pa is not None and pb is not None and pa != pb
    uids = []
    for who, pid in (("a", pa), ("b", pb)):
        uid = int(Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0])
        slot = slot_of_uid(uid - HOST_UID)
        assert slot is not None, f"{who}'s host runs as {uid}, outside the ledger's ranges"
        entry = UidLedger(LEDGER_DIR).holder(slot)
        assert entry and entry["sandbox_id"] == tenants.backend.host(tenants.name(who)).holder
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        assert tenants.backend.host(tenants.name(who)).id in cgroup
        uids.append(uid)
    assert uids[0] != uids[1]


def test_limits_past_a_tenants_host_are_refused_and_an_oom_stays_in_its_isolate(tenants):
    b = tenants.create("b")
    b.run_code("var kept = 'b is here'", language="javascript")
    pb = tenants.host_pid("b")
    with pytest.raises(LimitTooHigh) as err:
        tenants.create("a", memory_mb=7000)
    assert err.value.limit == "memory_mb" and err.value.maximum == HOST_BUDGET_MB - ISOLATE_OVERHEAD_MB
    # admitted, not allocated: two big isolates take A's budget; a third does not fit
    big = (HOST_BUDGET_MB - 200) // 2 - ISOLATE_OVERHEAD_MB
    held = [tenants.create("a", memory_mb=big) for _ in range(2)]
    with pytest.raises(LimitTooHigh) as err:
        tenants.create("a", memory_mb=256)
    assert err.value.maximum < 256
    tenants.create("b", memory_mb=256)  # B's host has its own budget
    for sb in held:
        sb.kill()
    greedy = tenants.create("a", memory_mb=256)
    pa = tenants.host_pid("a")
    # the attack: 24 x 256 MiB ArrayBuffers (6 GiB); the isolate's own limit ends it
    r = greedy.run_code(
        "const bufs = []; for (let i = 0; i < 24; i++) bufs.push(new Uint8Array(256 << 20).fill(1)); bufs.length",
        language="javascript",
        timeout=60,
    )
    assert r.error is not None or r.oom_killed, r
    # what it kept (256 MiB, at its limit) ends that isolate at its next run at the latest; then a
    # fresh one answers
    after = [greedy.run_code("'fresh'", language="javascript") for _ in range(2)]
    assert after[-1].text == "'fresh'", after
    assert tenants.host_pid("a") == pa and tenants.host_pid("b") == pb
    assert b.run_code("kept", language="javascript").text == "'b is here'"


def test_the_isolates_of_every_tenant_together_stay_within_the_machines_share(tenants):
    """Many tenants each within their own budget cannot together promise more memory than the
    isolate tier's share of the machine: the create past it is LimitTooHigh, nothing is made.
    Admitted, not allocated: the isolates take ~1 MiB each; the hosts ~65 MiB each."""
    share = int(machine_memory_mb() * MACHINE_SHARE)
    size = HOST_BUDGET_MB // 2 - ISOLATE_OVERHEAD_MB  # two fill a tenant's host
    stamp = secrets.token_hex(3)
    names = []
    refused = None
    made = []
    try:
        for n in range(share // HOST_BUDGET_MB + 2):
            name = f"iso-m{n}-{stamp}"
            names.append(name)
            key = tenants.engine.registry.tenants.create_key(name)[1]
            for _ in range(2):
                try:
                    made.append(
                        Sandbox.create(
                            tier="isolate",
                            timeout=120,
                            pool=False,
                            limits=Limits(memory_mb=size),
                            api_url=tenants.url,
                            api_key=key,
                        )
                    )
                except LimitTooHigh as e:
                    refused = e
                    break
            if refused is not None:
                break
        assert refused is not None, f"{len(made)} isolates of {size} MiB were admitted past {share} MiB"
        assert refused.source == "the isolate tier's share of this machine's memory", refused
        assert refused.maximum < size and len(made) * (size + ISOLATE_OVERHEAD_MB) <= share
        print(f"machine share {share} MiB: {len(made)} isolates of {size} MiB admitted, then {refused}")
        assert made[0].run_code("1 + 1", language="javascript").text == "2"
    finally:
        for sb in made:
            sb.kill()
        for name in names:
            tenants.backend.end_host(name)


def test_a_tenants_spinning_isolates_neither_end_nor_stall_another_tenants(tenants):
    b = tenants.create("b")
    b.run_code("var kept = 5", language="javascript")
    spinners = [tenants.create("a") for _ in range(3)]
    wasm = tenants.create("a")
    getter = tenants.create("a")
    pa, pb = tenants.host_pid("a"), tenants.host_pid("b")
    base = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert b.run_code("2 + 2", language="javascript").text == "4"
        base.append(time.perf_counter() - t0)
    spun: list[tuple[object, float]] = []

    def spin(sb: Sandbox, code: str, language: str) -> None:
        t0 = time.perf_counter()
        r = sb.run_code(code, language=language, timeout=SPIN_S)
        spun.append((r, time.perf_counter() - t0))

    threads = [threading.Thread(target=spin, args=(sb, "while (true) {}", "javascript")) for sb in spinners]
    threads.append(threading.Thread(target=spin, args=(wasm, WASM_LOOP, "wasm")))
    # a result whose getter spins: shown after the run, where isolated-vm's timer no longer runs (it
    # was copied on the host's own thread, hanging the host); the watchdog ends it
    threads.append(threading.Thread(target=spin, args=(getter, GETTER_SPIN, "javascript")))
    for t in threads:
        t.start()
    time.sleep(0.5)
    lat = []
    control: list[float] = []
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        assert b.run_code("2 + 2", language="javascript").text == "4"
        lat.append(time.perf_counter() - t0)
        if len(lat) == 5:  # A's own control path and Wasm jobs go on while its isolates spin
            t0 = time.perf_counter()
            fresh = tenants.create("a")
            assert fresh.run_code("3", language="javascript").text == "3"
            assert fresh.run_code(WASM_ANSWER, language="wasm").text == "42"
            spinners[0].metrics()
            control.append(time.perf_counter() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join(SPIN_S + 30)
    print(
        f"B's 2+2: before {statistics.median(base) * 1e3:.1f} ms median; while A spins: "
        f"median {statistics.median(lat) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms over {len(lat)} runs; "
        f"A's create + JS run + Wasm run + metrics meanwhile {[round(c * 1e3) for c in control]} ms"
    )
    assert max(lat) < STALL_BOUND_S, lat
    assert len(lat) >= 5, f"B ran only {len(lat)} times during A's {SPIN_S:g} s spin: {lat}"
    assert control and control[0] < 10.0
    assert len(spun) == 5
    for r, took in spun:
        assert getattr(r, "timed_out", False), r
        assert took < SPIN_S + WATCHDOG_S, took
    assert tenants.host_pid("a") == pa and tenants.host_pid("b") == pb  # neither host was ended
    assert b.run_code("kept", language="javascript").text == "5"


def test_a_killed_host_marks_its_tenants_sandboxes_lost_at_once_and_no_other(tenants):
    a1, a2 = tenants.create("a"), tenants.create("a")
    b = tenants.create("b")
    b.run_code("var kept = 9", language="javascript")
    pa = tenants.host_pid("a")
    assert pa is not None
    os.kill(pa, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(SandboxLost):  # the call that finds it gone says so at once
        a1.run_code("1", language="javascript")
    # the one nobody called: marked by the reaper (the daemon's tick)
    wait_for(lambda: tenants.engine.registry.sandboxes.get(a2.sandbox_id)[0].state is State.LOST, 10, "a2 to be lost")
    took = time.perf_counter() - t0
    print(f"A's sandboxes lost {took * 1e3:.0f} ms after its host was killed")
    assert tenants.engine.registry.sandboxes.get(a1.sandbox_id)[0].state is State.LOST
    assert b.run_code("kept", language="javascript").text == "9"
    # A gets a new host; its old sandboxes stay lost, never ready
    again = tenants.create("a")
    assert again.run_code("6 * 7", language="javascript").text == "42"
    assert tenants.host_pid("a") not in (None, pa)
    with pytest.raises(SandboxLost):
        a2.run_code("1", language="javascript")
    assert tenants.engine.registry.sandboxes.get(a2.sandbox_id)[0].state is State.LOST
    # nothing of them is left on the host; a kill ends their records
    for sb in (a1, a2):
        assert not Path(tenants.engine.registry.sandboxes.get(sb.sandbox_id)[1].state_dir).exists()
        sb.kill()
        assert tenants.engine.registry.sandboxes.get(sb.sandbox_id)[0].state is State.DESTROYED


def test_a_host_ends_on_sigterm_when_idle_and_when_its_home_is_deleted(tenants, runc_ready):
    backend = tenants.backend
    name = f"iso-term-{secrets.token_hex(3)}"
    backend.ensure_host(name)
    pid = backend.host_pid(name)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not host.running(pid), 5, "the host to end on SIGTERM")
    backend.end_host(name)
    # a host that held nothing for HOST_IDLE_S is ended by the reaper's tend_hosts
    backend.ensure_host(name)
    pid = backend.host_pid(name)
    live = [
        h
        for i, h in tenants.engine.registry.sandboxes.list(include_pooled=True, local=True)
        if i.tier == "isolate" and i.state in (State.READY, State.RUNNING, State.POOLED)
    ]
    backend.tend_hosts(live)
    assert backend.host_pid(name) == pid  # idle from now on
    idle = backend.host(name).idle
    idle.write_text(str(time.time() - HOST_IDLE_S - 1))  # as if that was a while ago
    backend.tend_hosts(live)
    assert backend.host_pid(name) is None and not host.running(pid)
    # a home of its own, deleted under its running host
    other = Path(f"/tmp/wbiso-{secrets.token_hex(3)}")
    other.mkdir(mode=0o700)
    engine = Engine(other)
    try:
        theirs = engine.backend("isolate")
        assert isinstance(theirs, IsolateBackend)
        theirs.ensure_host("")
        pid = theirs.host_pid("")
        host_id = theirs.host("").id
        assert pid is not None
        shutil.rmtree(other)
        wait_for(lambda: not host.running(pid), 5, "the host to end with its home")
        wait_for(lambda: host_id in backend.sweep_orphans(), 10, "the sweep of the host whose home is gone")
        assert not any(d.exists() for d in host.SandboxCgroup(host_id).dirs())
        ledger = UidLedger(LEDGER_DIR)
        assert not [s for s in ledger.held() if (ledger.holder(s) or {}).get("sandbox_id") == f"isolate-host:{host_id}"]
    finally:
        shutil.rmtree(other, ignore_errors=True)
        shutil.rmtree(engine.runtime, ignore_errors=True)
