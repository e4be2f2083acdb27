"""Attack: two WARMBOX_HOMEs on one host must never run sandboxes as the same host uids.

Registries are per home; uid ranges are not: they are claimed in the host-wide ledger
(/var/lib/warmbox/uids). Were two homes to hand out the same slot, a sandbox of one would be
the same host user as a sandbox of the other (one escape away from its files and processes).
The unit checks at the end use a private ledger (no sandbox, fast); the first runs real ones.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import _stop_daemon
from warmbox.engine import provision, teardown
from warmbox.engine.engine import Engine
from warmbox.errors import RegistryError
from warmbox.models import Limits, State
from warmbox.storage import uidslots
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import UidLedger

OTHER_CONFIG = """
[daemon]
idle_exit = 3

[pools]
"""


def _host_uids(engine: Engine, sandbox_id: str) -> set[int]:
    """Real uids of the sandbox's processes on the host (from its cgroup)."""
    out = set()
    for pid in engine.backend("container")._pids(sandbox_id):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out.add(int(status.split("\nUid:")[1].split()[0]))
    return out


@pytest.mark.sandbox
def test_two_homes_never_share_a_uid_range(home, runc_ready, tmp_path_factory):
    other = Path(f"/tmp/wbu-{os.urandom(3).hex()}")  # short: unix sockets live under its runtime dir
    other.mkdir(mode=0o700)
    (other / "warmbox.toml").write_text(OTHER_CONFIG)
    a, b = Engine.for_home(home), Engine.for_home(other)
    ledger = UidLedger()
    made: list[tuple[Engine, str]] = []

    async def one(engine: Engine):
        got = await provision.create(engine, tier="container", pool=False, timeout=120)
        made.append((engine, got.sandbox_id))
        await got.session.close()
        return got.info, got.handle

    try:
        # WARMBOX_CONFIG is unset in the session: each engine reads its own home's warmbox.toml
        async def both():
            return await asyncio.gather(one(a), one(b))

        (ia, ha), (ib, hb) = asyncio.run(both())
        assert ha.uid_base != hb.uid_base, "two homes handed out the same uid range"
        ws_a, ws_b = (os.stat(Path(h.state_dir) / "workspace").st_uid for h in (ha, hb))
        assert ws_a == ha.uid_base + 1000 and ws_b == hb.uid_base + 1000 and ws_a != ws_b
        ua, ub = _host_uids(a, ia.sandbox_id), _host_uids(b, ib.sandbox_id)
        assert ua and ub and not ua & ub, f"host uids overlap: {ua} / {ub}"
        for uids, h in ((ua, ha), (ub, hb)):  # each runs inside its own range
            assert all(h.uid_base <= u < h.uid_base + uidslots.UID_RANGE for u in uids), (uids, h.uid_base)
        # the host ledger names each home's sandbox
        sa, sb = ((h.uid_base - uidslots.UID_BASE) // uidslots.UID_RANGE for h in (ha, hb))
        with ledger.locked():
            ea, eb = ledger.holder(sa), ledger.holder(sb)
        assert ea["sandbox_id"] == ia.sandbox_id and ea["registry"] == str((home / "registry.db").resolve())
        assert eb["sandbox_id"] == ib.sandbox_id and eb["registry"] == str((other / "registry.db").resolve())
        # destroying frees the slot at once
        asyncio.run(teardown.destroy(b, ib.sandbox_id, "test"))
        made.remove((b, ib.sandbox_id))
        with ledger.locked():
            assert ledger.holder(sb) is None
            assert ledger.holder(sa)["sandbox_id"] == ia.sandbox_id
        asyncio.run(teardown.destroy(a, ia.sandbox_id, "test"))
        made.remove((a, ia.sandbox_id))
        with ledger.locked():
            assert ledger.holder(sa) is None
    finally:
        for engine, sid in made:
            try:
                asyncio.run(teardown.destroy(engine, sid, "test cleanup"))
            except Exception:
                pass
        _stop_daemon(other)
        Engine._instances.pop(other.resolve(), None)
        shutil.rmtree(b.runtime, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


# ---- the ledger itself (a private one: no sandbox, no host state)

# private ledgers hand out the host's last slots: ranges no real sandbox here is using (the
# host's ledger reaches them only after ~65000 sandboxes; the check for running processes is real)
HIGH = uidslots.MAX_SLOTS - 100


def _ledger(tmp: Path, slots: int, name: str = "uids") -> UidLedger:
    return UidLedger(tmp / name, slots=slots, first=HIGH)


def _reg(tmp: Path, name: str, ledger: UidLedger) -> Registry:
    return Registry(tmp / name / "registry.db", ledger=ledger)


def _alloc(reg: Registry, sid: str, state_dir: str = "/nonexistent") -> int:
    return reg.sandboxes.allocate(
        sid, "container", "base", 600, Limits(memory_mb=512, cpus=1.0, pids=256), state_dir, "/nonexistent"
    )


def test_concurrent_homes_get_distinct_slots(tmp_path):
    ledger = _ledger(tmp_path, 64, "uids")
    regs = [_reg(tmp_path, f"h{i}", ledger) for i in range(4)]
    got: list[int] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        r = Registry(regs[i].path, ledger=ledger)  # its own connection, like another process
        for j in range(10):
            slot = _alloc(r, f"sb-{i:06x}{j:06x}")
            with lock:
                got.append(slot)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 40 and len(set(got)) == 40
    assert len(ledger.held()) == 40
    # destroy releases: the entry is gone, and the range is the last to be handed out again
    regs[0].sandboxes.set_state("sb-000000000000", State.DESTROYED, "test")
    assert len(ledger.held()) == 39
    nxt = _alloc(regs[1], "sb-0100000000ff")
    assert nxt not in got


def test_a_full_ledger_is_a_typed_error_and_crashed_holders_are_reclaimed(tmp_path):
    ledger = _ledger(tmp_path, 4, "uids")
    a, b = _reg(tmp_path, "a", ledger), _reg(tmp_path, "b", ledger)
    live_dir = tmp_path / "paused-state"
    live_dir.mkdir()
    slots = {sid: _alloc(a, sid) for sid in ("sb-00000000000a", "sb-00000000000b", "sb-00000000000c")}
    slots["sb-00000000000d"] = _alloc(b, "sb-00000000000d", str(live_dir))
    with pytest.raises(RegistryError, match="all 4 uid ranges"):
        _alloc(b, "sb-0000000000e0")
    # a's process "crashed" after recording a destroy, before releasing its slot: reclaimable
    db = sqlite3.connect(a.path)
    db.execute("UPDATE sandboxes SET state='destroyed' WHERE sandbox_id='sb-00000000000a'")
    db.commit()
    assert (tmp_path / "uids" / str(slots["sb-00000000000a"])).exists()
    assert _alloc(b, "sb-0000000000e1") == slots["sb-00000000000a"]
    # paused with leftovers (its state dir) still holds; once they are gone it does not
    b.sandboxes.set_state("sb-00000000000d", State.READY, "test")
    b.sandboxes.set_state("sb-00000000000d", State.PAUSED, "test")
    with pytest.raises(RegistryError):
        _alloc(a, "sb-0000000000e2")
    live_dir.rmdir()
    assert _alloc(a, "sb-0000000000e3") == slots["sb-00000000000d"]
    # a whole home removed (its registry gone) frees every slot it held
    a.close()
    shutil.rmtree(tmp_path / "a")
    c = _reg(tmp_path, "c", ledger)
    again = {_alloc(c, f"sb-0000000000f{i}") for i in range(3)}
    assert again == {slots["sb-00000000000b"], slots["sb-00000000000c"], slots["sb-00000000000d"]}


def test_unreadable_holders_and_running_ranges_are_never_reclaimed(tmp_path):
    ledger = _ledger(tmp_path, 2, "uids")
    a = _reg(tmp_path, "a", ledger)
    s0, s1 = _alloc(a, "sb-0000000000a0"), _alloc(a, "sb-0000000000a1")
    # slot s0's holder: a registry that exists but cannot be read
    (tmp_path / "garbage.db").write_bytes(b"not a database" * 100)
    with ledger.locked():
        (tmp_path / "uids" / str(s0)).unlink()
        assert ledger.adopt(s0, str(tmp_path / "garbage.db"), "sb-0000000000a0")
    # slot s1: its holder is gone, but a process still runs in its range
    db = sqlite3.connect(a.path)
    db.execute("UPDATE sandboxes SET state='destroyed'")
    db.commit()
    proc = subprocess.Popen(["sleep", "60"], user=uidslots.uid_base(s1) + 1000, group=uidslots.uid_base(s1) + 1000)
    try:
        b = _reg(tmp_path, "b", ledger)
        with pytest.raises(RegistryError, match="all 2 uid ranges"):
            _alloc(b, "sb-0000000000b0")
    finally:
        proc.kill()
        proc.wait()
    assert _alloc(b, "sb-0000000000b1") == s1  # nothing runs there any more
    with pytest.raises(RegistryError):
        _alloc(b, "sb-0000000000b2")  # the unreadable holder keeps s0


def test_sandboxes_from_before_the_ledger_are_adopted(tmp_path):
    """A home whose sandboxes were created before the ledger existed records them when opened."""
    ledger = _ledger(tmp_path, 8, "uids")
    old_ledger = _ledger(tmp_path, 8, "old-uids")  # stands in for "no ledger yet"
    a = _reg(tmp_path, "a", old_ledger)
    held = _alloc(a, "sb-0000000000a0")
    a.close()
    a = Registry(tmp_path / "a" / "registry.db", ledger=ledger)
    with ledger.locked():
        assert ledger.holder(held)["sandbox_id"] == "sb-0000000000a0"
    b = _reg(tmp_path, "b", ledger)
    assert all(_alloc(b, f"sb-0000000000b{i}") != held for i in range(7))
