"""Tenants, API keys and quotas: the registry's keys and atomic quota checks (no sandbox), the
engine front's scoping with real sandboxes, and ``warmbox keys``."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli, wait_for
from warmbox import operations as ops
from warmbox.errors import Forbidden, QuotaExceeded, SandboxNotFound
from warmbox.models import Limits, State, Tenant
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

EXIT_ERROR = 125  # the CLI's status for every error (warmbox.cli.main)


def _registry(tmp: Path, slots: int = 32) -> Registry:
    # its own uid ledger: these rows never run, so they must not hold real ranges of the host
    return Registry(tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=slots, first=MAX_SLOTS - 100))


def _allocate(reg: Registry, sid: str, tenant: Tenant | None, limits: Limits | None = None, **kw: Any) -> int:
    lim = limits or Limits()
    return reg.sandboxes.allocate(
        sid, "container", "base", 3600, lim, "/nonexistent", "/nonexistent", tenant=tenant, **kw
    )


def _sid(i: int) -> str:
    return f"sb-{i:012x}"


# ---- registry: keys


def test_only_the_hash_of_a_secret_is_stored(tmp_path):
    reg = _registry(tmp_path)
    key_id, secret = reg.tenants.create_key("acme", max_sandboxes=3, tiers=["runc"])
    assert secret.startswith("wbx_") and len(secret) > 40
    dump = "\n".join(sqlite3.connect(tmp_path / "r.db").iterdump())
    assert secret not in dump and secret[4:] not in dump
    assert hashlib.sha256(secret.encode()).hexdigest() in dump
    for f in tmp_path.iterdir():  # the WAL too
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    t = reg.tenants.authenticate(secret)
    assert t == Tenant("acme", max_sandboxes=3, tiers=("container",), key_id=key_id)
    assert reg.tenants.tenant("acme") == dataclasses.replace(t, key_id="")
    for wrong in (secret + "x", secret[:-1], "wbx_", "", None, 42, "x" * 10000, secret.upper()):
        assert reg.tenants.authenticate(wrong) is None  # type: ignore[arg-type]
    [k] = reg.tenants.list_keys()
    assert (k.key_id, k.tenant, k.revoked_at, k.admin, k.max_sandboxes, k.tiers) == (
        key_id,
        "acme",
        0,
        False,
        3,
        ("container",),
    )


def test_a_second_key_updates_only_the_quotas_given(tmp_path):
    reg = _registry(tmp_path)
    reg.tenants.create_key("acme", max_sandboxes=3, max_memory_mb=2048)
    key_id, secret = reg.tenants.create_key("acme", admin=True, max_cpus=2.5)
    t = reg.tenants.authenticate(secret)
    assert t is not None and t.admin and t.key_id == key_id
    assert (t.max_sandboxes, t.max_memory_mb, t.max_cpus, t.tiers) == (3, 2048, 2.5, ())
    assert [k.admin for k in reg.tenants.list_keys()] == [False, True]


@pytest.mark.parametrize(
    "kw",
    [
        {"tenant": ""},
        {"tenant": "a b"},
        {"tenant": "-x"},
        {"tenant": "x" * 65},
        {"max_sandboxes": -1},
        {"max_sandboxes": 1.5},
        {"max_sandboxes": True},
        {"max_memory_mb": float("inf")},
        {"max_cpus": float("nan")},
        {"tiers": "container"},
        {"tiers": ["nope"]},
        {"rate_per_s": -2},
        {"admin": "yes"},
    ],
)
def test_bad_key_arguments_are_typed_errors_and_change_nothing(tmp_path, kw):
    from warmbox.errors import InvalidArgument

    reg = _registry(tmp_path)
    tenant = kw.pop("tenant", "acme")
    with pytest.raises(InvalidArgument):
        reg.tenants.create_key(tenant, **kw)
    assert reg.tenants.list_keys() == []


def test_revoke_takes_effect_at_once_in_every_process(tmp_path):
    server = _registry(tmp_path)
    key_id, secret = server.tenants.create_key("acme")
    _, other = server.tenants.create_key("acme")
    assert server.tenants.authenticate(secret) is not None
    admin = Registry(tmp_path / "r.db", ledger=server.ledger)  # its own connection, like the CLI's process
    assert admin.tenants.revoke_key(key_id) is True
    assert server.tenants.authenticate(secret) is None  # the very next request
    assert server.tenants.authenticate(other) is not None  # the tenant's other key still works
    assert admin.tenants.revoke_key(key_id) is False and admin.tenants.revoke_key("key-nope") is False
    [k, _] = server.tenants.list_keys()
    assert k.key_id == key_id and k.revoked_at > 0


# ---- registry: quotas


def test_quotas_refuse_and_create_nothing(tmp_path):
    reg = _registry(tmp_path)
    _, secret = reg.tenants.create_key("acme", max_sandboxes=3, max_memory_mb=1024, max_cpus=1.5, tiers=["container"])
    t = reg.tenants.authenticate(secret)
    assert t is not None
    _allocate(reg, _sid(1), t, Limits(memory_mb=512, cpus=1.0))
    cases = [
        (Limits(memory_mb=600), "memory_mb", 1112, 1024),
        (Limits(memory_mb=256, cpus=1.0), "cpus", 2.0, 1.5),
    ]
    for limits, limit, value, maximum in cases:
        with pytest.raises(QuotaExceeded) as e:
            _allocate(reg, _sid(9), t, limits)
        assert (e.value.limit, e.value.value, e.value.maximum) == (limit, value, maximum), e.value
        assert "acme" in str(e.value)
    with pytest.raises(QuotaExceeded) as e:
        reg.sandboxes.allocate(_sid(9), "gvisor", "base", 60, Limits(memory_mb=256), "/x", "/x", tenant=t)
    assert (e.value.limit, e.value.value, e.value.maximum) == ("tier", "gvisor", "container")
    assert reg.sandboxes.sandbox_tenant(_sid(9)) is None  # no row
    assert [p.name for p in reg.ledger.dir.iterdir() if p.name.isdigit()] == [str(reg.ledger.first)]  # sb-1's only
    _allocate(reg, _sid(2), t, Limits(memory_mb=256, cpus=0.25))
    with pytest.raises(QuotaExceeded):
        reg.tenants.check_quota(t, "container", Limits(memory_mb=300, cpus=0.1))
    _allocate(reg, _sid(3), t, Limits(memory_mb=256, cpus=0.25))
    with pytest.raises(QuotaExceeded) as e:
        _allocate(reg, _sid(4), t, Limits(memory_mb=16, cpus=0.01))
    assert (e.value.limit, e.value.value, e.value.maximum) == ("sandboxes", 4, 3)
    # another tenant and the host are not counted against acme, nor limited by it
    _allocate(reg, _sid(5), Tenant("other"), Limits(memory_mb=4096))
    _allocate(reg, _sid(6), None, Limits(memory_mb=4096))
    assert reg.sandboxes.sandbox_tenant(_sid(5)) == "other" and reg.sandboxes.sandbox_tenant(_sid(6)) == ""
    assert {i.sandbox_id for i, _ in reg.sandboxes.list(include_dead=True, tenant="acme")} == {
        _sid(1),
        _sid(2),
        _sid(3),
    }


def test_paused_and_ended_sandboxes_do_not_count(tmp_path):
    reg = _registry(tmp_path)
    _, secret = reg.tenants.create_key("acme", max_sandboxes=1, max_memory_mb=512)
    t = reg.tenants.authenticate(secret)
    assert t is not None
    _allocate(reg, _sid(1), t, Limits(memory_mb=512))
    reg.sandboxes.set_state(_sid(1), State.READY, "test")
    with pytest.raises(QuotaExceeded):
        _allocate(reg, _sid(2), t, Limits(memory_mb=512))
    reg.sandboxes.set_state(_sid(1), State.PAUSED, "test")  # its runtime is released: it holds no memory or CPU
    _allocate(reg, _sid(2), t, Limits(memory_mb=512))
    reg.sandboxes.set_state(_sid(2), State.DESTROYED, "test")
    _allocate(reg, _sid(3), t, Limits(memory_mb=512))


def test_concurrent_creates_for_the_last_slot_exactly_one_wins(tmp_path):
    reg = _registry(tmp_path)
    _, secret = reg.tenants.create_key("acme", max_sandboxes=4)
    t = reg.tenants.authenticate(secret)
    assert t is not None
    for i in range(3):
        _allocate(reg, _sid(i), t)
    won: list[str] = []
    refused: list[QuotaExceeded] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def create(i: int) -> None:
        r = Registry(reg.path, ledger=reg.ledger)  # its own connection, like another process
        start.wait()
        try:
            _allocate(r, _sid(100 + i), t)
            with lock:
                won.append(_sid(100 + i))
        except QuotaExceeded as e:
            with lock:
                refused.append(e)
        finally:
            r.close()

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(won) == 1 and len(refused) == 7
    assert len(reg.sandboxes.list(include_dead=True, tenant="acme")) == 4


def test_concurrent_claims_stop_at_the_quota_and_leave_the_rest_pooled(tmp_path):
    reg = _registry(tmp_path)
    for i in range(8):
        _allocate(reg, _sid(i), None, Limits(memory_mb=512), pool="p", shape="s")
        reg.sandboxes.set_state(_sid(i), State.POOLED, "test")
    _, secret = reg.tenants.create_key("acme", max_sandboxes=3)
    t = reg.tenants.authenticate(secret)
    assert t is not None
    got: list[str] = []
    refused: list[QuotaExceeded] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def claim() -> None:
        r = Registry(reg.path, ledger=reg.ledger)
        start.wait()
        try:
            c = r.pools.claim("p", "s", 60, "test", t)
            assert c is not None
            with lock:
                got.append(c[0].sandbox_id)
        except QuotaExceeded as e:
            with lock:
                refused.append(e)
        finally:
            r.close()

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 3 and len(refused) == 5
    assert all(reg.sandboxes.sandbox_tenant(s) == "acme" for s in got)
    left = reg.pools.pooled("p")
    assert len(left) == 5 and all(reg.sandboxes.sandbox_tenant(s) == "" for s in left)  # still the pool's
    assert [e.kind for e in reg.pools.pool_events("p")].count("hit") == 3  # a refused claim left no trace


def test_snapshots_belong_to_their_sandboxs_tenant(tmp_path):
    reg = _registry(tmp_path)
    _allocate(reg, _sid(1), Tenant("acme"))
    _allocate(reg, _sid(2), None)
    reg.snapshots.add_snapshot("snap-a", _sid(1), 1.0, 10)
    reg.snapshots.add_snapshot("snap-h", _sid(2), 2.0, 10)
    assert reg.snapshots.snapshot_tenant("snap-a") == "acme" and reg.snapshots.snapshot_tenant("snap-h") == ""
    assert reg.snapshots.snapshot_tenant("snap-nope") is None
    assert [r[0] for r in reg.snapshots.all_snapshots("acme")] == ["snap-a"]
    assert [r[0] for r in reg.snapshots.all_snapshots()] == ["snap-a", "snap-h"]


# the two tables as schema version 5 had them (before tenants)
V5 = """
CREATE TABLE sandboxes (
    sandbox_id TEXT PRIMARY KEY, tier TEXT NOT NULL, template TEXT NOT NULL, state TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, memory_mb INTEGER NOT NULL, cpus REAL NOT NULL,
    pids INTEGER NOT NULL, uid_slot INTEGER NOT NULL, runtime_id TEXT NOT NULL, state_dir TEXT NOT NULL,
    socket_path TEXT NOT NULL, pool TEXT NOT NULL DEFAULT '', claimed_at REAL NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '', ended_at REAL NOT NULL DEFAULT 0, shape TEXT NOT NULL DEFAULT '',
    file_size_mb INTEGER NOT NULL DEFAULT 1024, open_files INTEGER NOT NULL DEFAULT 1024,
    tmp_mb INTEGER NOT NULL DEFAULT 256, parent_snapshot TEXT NOT NULL DEFAULT '',
    disk_mb INTEGER NOT NULL DEFAULT 10240
);
CREATE TABLE snapshots (
    snapshot_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, created_at REAL NOT NULL, size_bytes INTEGER NOT NULL
);
INSERT INTO sandboxes (sandbox_id, tier, template, state, created_at, expires_at, memory_mb, cpus, pids,
    uid_slot, runtime_id, state_dir, socket_path)
    VALUES ('sb-00000000000a', 'container', 'base', 'destroyed', 1, 2, 512, 1.0, 256, 3, 'x', '/x', '/x');
INSERT INTO snapshots VALUES ('snap-old', 'sb-00000000000a', 1.5, 99);
PRAGMA user_version = 5;
"""


def test_an_old_database_is_migrated(tmp_path):
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(V5)
    db.close()
    reg = _registry(tmp_path)
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert reg.sandboxes.sandbox_tenant("sb-00000000000a") == "" and reg.snapshots.snapshot_tenant("snap-old") == ""
    assert [r[0] for r in reg.snapshots.all_snapshots()] == ["snap-old"] and reg.snapshots.all_snapshots("acme") == []
    _, secret = reg.tenants.create_key("acme", max_sandboxes=1)
    t = reg.tenants.authenticate(secret)
    assert t is not None
    _allocate(reg, _sid(1), t)
    reg.snapshots.add_snapshot("snap-new", _sid(1), 3.0, 1)
    assert reg.snapshots.snapshot_tenant("snap-new") == "acme"
    reg.close()
    reg = _registry(tmp_path)  # opening it again is a no-op
    assert reg.sandboxes.sandbox_tenant(_sid(1)) == "acme" and len(reg.tenants.list_keys()) == 1


# ---- the engine front


def test_a_tenant_front_refuses_admin_ops_and_unknown_ids_without_a_sandbox(tmp_path):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront
    from warmbox.errors import InvalidArgument

    engine = Engine(tmp_path / "home")
    front = EngineFront(engine, Tenant("b"))
    with pytest.raises(Forbidden):
        asyncio.run(front.handle(ops.GcSnapshots()))
    with pytest.raises(Forbidden, match="template gc is for admin keys"):
        asyncio.run(front.handle(ops.TemplateGc(dry_run=True)))
    # a registry pull runs on the host, outside every network policy: only from listed registries
    from warmbox.templates import Template

    # a Docker Hub name (docker.io, mirrored or not) is a registry like any other
    for ref in ("127.0.0.1:22/x:1", "169.254.169.254/latest:1", "internal.example:5000/a/b:c", "python:3.11-slim"):
        with pytest.raises(Forbidden, match="template_registries lists none"):
            asyncio.run(front.handle(ops.TemplateBuild("t", Template.from_registry(ref, tls_verify=False))))
    with pytest.raises(Forbidden, match="admin keys only"):
        asyncio.run(front.handle(ops.TemplateBuild("t", Template.from_oci("/etc"))))
    with pytest.raises(SandboxNotFound, match=r"^no sandbox sb-000000000000$"):
        asyncio.run(front.handle(ops.Info("sb-000000000000")))
    with pytest.raises(SandboxNotFound, match="ids look like"):
        asyncio.run(front.handle(ops.Kill("../x")))
    with pytest.raises(SandboxNotFound, match=r"^no snapshot snap-0$"):
        asyncio.run(front.handle(ops.DeleteSnapshot("snap-0")))
    with pytest.raises(InvalidArgument):
        asyncio.run(front.handle(ops.DeleteSnapshot("nope")))
    assert asyncio.run(front.handle(ops.ListSnapshots())) == []
    with pytest.raises(InvalidArgument):
        EngineFront(engine, Tenant(""))


# values for the required fields of a request besides its sandbox id: a new op with another
# required field fails here until it is given one, so no op escapes the check below
_ARGS: dict[str, object] = {
    "cmd": "true",
    "code": "1",
    "context": "default",
    "path": "f",
    "data": "x",
    "timeout": 30.0,
    "duration_ms": 1.0,
    "network": "none",
    "pid": 1,
    "cols": 80,
    "rows": 24,
    "files": (),
    "old_path": "a",
    "new_path": "b",
    "port": 8000,
}


def _request(cls: type, sandbox_id: str) -> ops.Request[Any]:
    kw: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name == "sandbox_id":
            kw[f.name] = sandbox_id
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert f.name in _ARGS, f"give {cls.__name__}.{f.name} a value in _ARGS"
            kw[f.name] = _ARGS[f.name]
    return cls(**kw)


def _names_sandbox(cls: type) -> bool:
    return any(f.name == "sandbox_id" for f in dataclasses.fields(cls))


async def _refused_like_unknown(front: Any, theirs: ops.Request[Any], unknown: ops.Request[Any], ids: tuple) -> str:
    with pytest.raises(SandboxNotFound) as a:
        await front.handle(theirs)
    with pytest.raises(SandboxNotFound) as u:
        await front.handle(unknown)
    assert type(a.value) is type(u.value)
    assert str(a.value).replace(ids[0], "ID") == str(u.value).replace(ids[1], "ID"), (theirs, a.value, u.value)
    return str(a.value)


@pytest.mark.sandbox
def test_another_tenants_sandbox_and_snapshot_are_unknown_ids(home, runc_ready):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront

    engine = Engine.for_home(home)
    reg = engine.registry
    a, b = (reg.tenants.authenticate(reg.tenants.create_key(name)[1]) for name in ("t-a", "t-b"))
    assert a is not None and b is not None

    async def go() -> list[str]:
        fa, fb, root = EngineFront(engine, a), EngineFront(engine, b), EngineFront(engine)
        sid, snap = "", ""
        try:
            sid = (await fa.handle(ops.Create(pool=False, timeout=300))).info.sandbox_id
            assert reg.sandboxes.sandbox_tenant(sid) == "t-a"
            await fa.handle(ops.WriteFile(sid, "f", "mine"))
            snap = (await fa.handle(ops.Snapshot(sid))).snapshot_id
            assert reg.snapshots.snapshot_tenant(snap) == "t-a"
            nobody = "sb-" + secrets.token_hex(6)
            checked = []
            for op, cls in ops.REQUESTS.items():
                if _names_sandbox(cls):
                    await _refused_like_unknown(fb, _request(cls, sid), _request(cls, nobody), (sid, nobody))
                    checked.append(op.value)
            no_snap = "snap-" + secrets.token_hex(8)
            for make in (
                ops.Resume,
                lambda r: ops.Create(from_snapshot=r),
                lambda r: ops.CreateAndRun(ops.Create(from_snapshot=r), "1"),  # its create checked as one
                ops.DeleteSnapshot,
            ):
                msg = await _refused_like_unknown(fb, make(snap), make(no_snap), (snap, no_snap))
                assert msg == f"no snapshot {snap}"
                checked.append(type(make(snap)).__name__)
            await _refused_like_unknown(fb, ops.Resume(sid), ops.Resume(nobody), (sid, nobody))
            assert sid not in {i.sandbox_id for i in await fb.handle(ops.ListSandboxes(include_dead=True))}
            assert await fb.handle(ops.ListSnapshots()) == []
            with pytest.raises(Forbidden):
                await fb.handle(ops.GcSnapshots())
            # nothing of A's was touched, and A and the host still see it
            assert await fa.handle(ops.ReadFile(sid, "f")) == b"mine"
            assert [i.sandbox_id for i in await fa.handle(ops.ListSandboxes())] == [sid]
            assert [r[0] for r in await fa.handle(ops.ListSnapshots())] == [snap]
            assert sid in {i.sandbox_id for i in await root.handle(ops.ListSandboxes())}
            return checked
        finally:
            if snap:
                await root.handle(ops.DeleteSnapshot(snap))
            for other in {sid, *(i.sandbox_id for t in ("t-a", "t-b") for i in engine.list(tenant=t))} - {""}:
                await root.handle(ops.Kill(other))
            for f in (fa, fb, root):
                await f.close()

    checked = asyncio.run(go())
    assert {"exec", "files.read", "kill", "snapshot", "pause", "network.log", "connect"} <= set(checked)


@pytest.mark.sandbox
def test_quota_refuses_the_next_start_and_a_pooled_claim_is_stamped(home, runc_ready):
    from tests.conftest import POOLED_LIMITS_MB
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront

    engine = Engine.for_home(home)
    reg = engine.registry
    q = reg.tenants.authenticate(reg.tenants.create_key("t-q", max_sandboxes=1, max_memory_mb=POOLED_LIMITS_MB - 1)[1])
    c = reg.tenants.authenticate(reg.tenants.create_key("t-c")[1])
    assert q is not None and c is not None
    engine.ensure_daemon()
    wait_for(lambda: reg.pools.pool_counts("iso")[0] >= 1, 120, "the iso pool to fill")

    def rows() -> set[str]:
        return {i.sandbox_id for i in engine.list(include_dead=True)}

    async def go() -> None:
        fq, fc, root = EngineFront(engine, q), EngineFront(engine, c), EngineFront(engine)
        made: list[str] = []
        snaps: list[str] = []
        try:
            first = (await fq.handle(ops.Create(pool=False, timeout=300, limits=Limits(memory_mb=256)))).info
            made.append(first.sandbox_id)
            before, pooled = rows(), reg.pools.pooled("iso")
            with pytest.raises(QuotaExceeded) as e:
                await fq.handle(ops.Create(pool=False, timeout=300, limits=Limits(memory_mb=128)))
            assert (e.value.limit, e.value.value, e.value.maximum) == ("sandboxes", 2, 1)
            # the pool's shape asks for more memory than t-q may have: refused, the pool keeps its sandbox
            with pytest.raises(QuotaExceeded):
                await fq.handle(ops.Create(timeout=300, limits=Limits(memory_mb=POOLED_LIMITS_MB)))
            assert rows() == before and reg.pools.pooled("iso") == pooled
            assert [i.sandbox_id for i in await fq.handle(ops.ListSandboxes())] == [first.sandbox_id]
            # a claim stamps the claimer
            got = (await fc.handle(ops.Create(timeout=300, limits=Limits(memory_mb=POOLED_LIMITS_MB)))).info
            made.append(got.sandbox_id)
            assert (
                got.pool == "iso" and got.sandbox_id in pooled and reg.sandboxes.sandbox_tenant(got.sandbox_id) == "t-c"
            )
            # a paused sandbox holds nothing: another may start; resuming the paused one is then refused
            snaps.append((await fq.handle(ops.Pause(first.sandbox_id))).snapshot_id)
            second = (await fq.handle(ops.Create(pool=False, timeout=300, limits=Limits(memory_mb=256)))).info
            made.append(second.sandbox_id)
            with pytest.raises(QuotaExceeded):
                await fq.handle(ops.Resume(first.sandbox_id))
            assert reg.sandboxes.get(first.sandbox_id)[0].state is State.PAUSED
            await fq.handle(ops.Kill(second.sandbox_id))
            resumed = (await fq.handle(ops.Resume(first.sandbox_id))).info
            made.append(resumed.sandbox_id)
            assert reg.sandboxes.sandbox_tenant(resumed.sandbox_id) == "t-q"
        finally:
            for sid in {*made, *(i.sandbox_id for t in ("t-q", "t-c") for i in engine.list(tenant=t))}:
                await root.handle(ops.Kill(sid))  # running or paused
            for s in snaps:
                await root.handle(ops.DeleteSnapshot(s))
            for f in (fq, fc, root):
                await f.close()

    asyncio.run(go())


# ---- warmbox keys


def test_keys_cli_shows_a_secret_once_and_revokes_it(tmp_path):
    env = {"WARMBOX_HOME": str(tmp_path / "home")}
    r = cli("keys", "create", "--tenant", "acme", "--max-sandboxes", "2", "--max-memory-gb", "1.5", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    key_id = lines[0].split()[1]
    secret = lines[1]
    assert key_id.startswith("key-") and secret.startswith("wbx_") and "shown once" in r.stdout
    reg = Registry(tmp_path / "home" / "registry.db", ledger=UidLedger(tmp_path / "uids"))
    t = reg.tenants.authenticate(secret)
    assert t is not None and (t.name, t.max_sandboxes, t.max_memory_mb, t.admin) == ("acme", 2, 1536, False)
    r = cli("keys", "create", "--tenant", "ops", "--admin", "--tiers", "runc,gvisor", "--rate", "5", env=env)
    assert r.returncode == 0, r.stderr
    ls = cli("keys", "ls", env=env)
    assert ls.returncode == 0 and key_id in ls.stdout and "acme" in ls.stdout and "container,gvisor" in ls.stdout
    assert "wbx_" not in ls.stdout and "wbx_" not in cli("keys", "ls", "--json", env=env).stdout
    r = cli("keys", "revoke", key_id, env=env)
    assert r.returncode == 0 and "revoked" in r.stdout
    assert reg.tenants.authenticate(secret) is None
    r = cli("keys", "revoke", key_id, env=env)
    assert r.returncode == EXIT_ERROR and "no live key" in r.stderr


def test_keys_cli_bad_input_is_one_line_error(tmp_path):
    env = {"WARMBOX_HOME": str(tmp_path / "home")}
    for args in (
        ["keys", "create"],
        ["keys", "create", "--tenant", ""],
        ["keys", "create", "--tenant", "a b"],
        ["keys", "create", "--tenant", "x", "--max-sandboxes", "-1"],
        ["keys", "create", "--tenant", "x", "--max-sandboxes", "abc"],
        ["keys", "create", "--tenant", "x", "--max-memory-gb", "nan"],
        ["keys", "create", "--tenant", "x", "--max-cpus", "-1"],
        ["keys", "create", "--tenant", "x", "--tiers", "nope"],
        ["keys", "create", "--tenant", "x", "--tiers", ","],
        ["keys", "create", "--tenant", "x", "--rate", "inf"],
        ["keys", "revoke"],
        ["keys", "revoke", "key-000000000000"],
        ["keys", "nope"],
    ):
        r = cli(*args, env=env)
        assert r.returncode == EXIT_ERROR, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert "key-" not in cli("keys", "ls", env=env).stdout  # nothing was made


def test_a_tenant_pulls_a_template_only_from_a_listed_registry(tmp_path):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront
    from warmbox.errors import ImageRegistryUnreachable, WarmboxError
    from warmbox.templates import Template

    home = tmp_path / "home"
    home.mkdir()
    (home / "warmbox.toml").write_text('[server]\ntemplate_registries = ["127.0.0.1:1"]\n[pools]\n')
    front = EngineFront(Engine(home), Tenant("b"))
    with pytest.raises(Forbidden, match=r"lists 127\.0\.0\.1:1"):
        asyncio.run(front.handle(ops.TemplateBuild("t", Template.from_registry("127.0.0.1:2/x:1", tls_verify=False))))
    # a listed one passes the check: the pull itself then fails (nothing listens on port 1)
    with pytest.raises(WarmboxError) as err:
        asyncio.run(front.handle(ops.TemplateBuild("t", Template.from_registry("127.0.0.1:1/x:1", tls_verify=False))))
    assert isinstance(err.value, ImageRegistryUnreachable) and err.value.registry == "127.0.0.1:1", err.value
