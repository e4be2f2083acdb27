"""Attack: ask for more than the host has (or the admin allows) and hope the limit is not enforced.

``Limits(memory_mb=10**9, cpus=1000, tmp_mb=10**9)`` would be an unlimited sandbox (and a tmpfs
that takes the host's memory). Every way a sandbox comes to exist — create, a pool, resume,
create(from_snapshot) — refuses it with LimitTooHigh before any row or directory exists, naming
the limit, the value, the maximum and where the maximum comes from (the host, a default, or
``[limits]`` in warmbox.toml / WARMBOX_LIMITS__*). The checks that need no sandbox come first.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import cli, set_config
from warmbox import Limits, Sandbox, State, config
from warmbox.config import HostCapacity
from warmbox.engine import provision, teardown
from warmbox.engine.engine import Engine
from warmbox.errors import ConfigError, InvalidArgument, LimitTooHigh

HOST = HostCapacity(memory_mb=8192, cpus=4, pids=32768, open_files=1 << 20, disk_mb=100_000)
ABSURD = [
    ("memory_mb", Limits(memory_mb=10**9)),
    ("cpus", Limits(cpus=1000)),
    ("tmp_mb", Limits(tmp_mb=10**9)),
    ("pids", Limits(pids=10**7)),
    ("file_size_mb", Limits(file_size_mb=10**12)),
    ("open_files", Limits(open_files=10**8)),
    ("disk_mb", Limits(disk_mb=10**9)),
]


# ---- pure validation (no sandbox)


@pytest.mark.parametrize("field,limits", ABSURD, ids=[f for f, _ in ABSURD])
def test_absurd_limits_are_refused_naming_limit_value_maximum_and_source(field, limits):
    maxima = config.parse({}, host=HOST).limits
    with pytest.raises(LimitTooHigh) as e:
        maxima.check(limits)
    err = e.value
    assert isinstance(err, InvalidArgument)
    assert err.limit == field and err.value == getattr(limits, field)
    assert f"limits.{field} = {getattr(limits, field)!r}" in str(err)
    assert config._fmt(err.maximum) in str(err) and err.source and err.source in str(err)


def test_defaults_come_from_the_host():
    m = config.parse({}, host=HOST).limits
    assert m.max_memory_mb == 8192 - config.memory_reserve_mb(8192) and "MemTotal 8192" in m.sources["max_memory_mb"]
    assert m.max_cpus == 4 and m.max_pids == 32768 // 4 and m.max_tmp_mb == m.max_memory_mb
    assert m.max_file_size_mb == 100_000 and m.max_open_files == 65536
    m.check(Limits())  # the default limits fit any host
    m.check(Limits(memory_mb=m.max_memory_mb, cpus=4, pids=m.max_pids, tmp_mb=m.max_memory_mb))
    # this host's own capacity is read without error and admits the defaults too
    config.parse({}).limits.check(Limits())


def test_tmpfs_is_bounded_by_the_sandboxs_memory():
    m = config.parse({}, host=HOST).limits
    assert Limits(memory_mb=128).tmp_mb == 128 and Limits().tmp_mb == 256  # the default follows memory
    with pytest.raises(LimitTooHigh, match=r"limits.tmp_mb = 600 is above its limits.memory_mb = 512"):
        m.check(Limits(memory_mb=512, tmp_mb=600))
    m.check(Limits(memory_mb=512, tmp_mb=512))


def test_admin_maxima_from_the_file_and_the_environment_are_honoured():
    m = config.parse(
        {
            "limits": {
                "max_memory_mb": 1024,
                "max_cpus": 0.5,
                "max_pids": 100,
                "max_tmp_mb": 64,
                "max_file_size_mb": 10,
                "max_open_files": 128,
            }
        },
        "/etc/wb.toml",
        env_keys=frozenset({"max_cpus"}),
        host=HOST,
    ).limits
    within = {"memory_mb": 1024, "cpus": 0.5, "pids": 100, "tmp_mb": 64, "file_size_mb": 10, "open_files": 128}
    for field, value, where in (
        ("memory_mb", 2048, "/etc/wb.toml [limits] max_memory_mb"),
        ("cpus", 1.0, "WARMBOX_LIMITS__MAX_CPUS"),
        ("pids", 101, "/etc/wb.toml [limits] max_pids"),
        ("tmp_mb", 65, "/etc/wb.toml [limits] max_tmp_mb"),
        ("file_size_mb", 11, "max_file_size_mb"),
        ("open_files", 129, "max_open_files"),
    ):
        with pytest.raises(LimitTooHigh, match=f"limits.{field} = {value!r} is above") as e:
            m.check(Limits(**{**within, field: value}))
        assert where in str(e.value), str(e.value)
    m.check(Limits(**within))
    # an admin maximum above the host's capacity: the host's bound stands, and says so
    big = config.parse({"limits": {"max_memory_mb": 10**6, "max_cpus": 64}}, "f.toml", host=HOST).limits
    assert big.max_memory_mb == 8192 and "asks for 1000000" in big.sources["max_memory_mb"]
    assert big.max_cpus == 4
    # the built-in pool is dropped when the admin's maxima leave no room for it (declared ones are errors)
    assert "default" in config.parse({}, host=HOST).pools
    assert not config.parse({"limits": {"max_cpus": 0.5}}, host=HOST).pools


def test_env_override_reaches_the_loaded_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_CONFIG", str(tmp_path / "warmbox.toml"))
    (tmp_path / "warmbox.toml").write_text("[limits]\nmax_memory_mb = 2000\n")
    monkeypatch.setenv("WARMBOX_LIMITS__MAX_PIDS", "300")
    s = config.load(tmp_path)
    assert s.limits.max_memory_mb == 2000 and s.limits.max_pids == 300
    assert s.limits.sources["max_pids"] == "WARMBOX_LIMITS__MAX_PIDS"
    with pytest.raises(LimitTooHigh, match="WARMBOX_LIMITS__MAX_PIDS"):
        s.limits.check(Limits(pids=301))
    monkeypatch.setenv("WARMBOX_LIMITS__MAX_PIDS", "many")
    with pytest.raises(ConfigError, match="WARMBOX_LIMITS__MAX_PIDS"):
        config.load(tmp_path)


@pytest.mark.parametrize(
    "body,match",
    [
        ({"limits": {"max_memory_mb": -5}}, "limits.max_memory_mb must be an integer"),
        ({"limits": {"max_cpus": "all"}}, "limits.max_cpus must be a number"),
        ({"limits": {"max_ram": 5}}, "unknown key limits.max_ram"),
        ({"limits": 5}, "limits must be a table"),
        (
            {"limits": {"max_memory_mb": 400}, "pools": {"big": {"limits": {"memory_mb": 512}}}},
            r"pools.big.limits.memory_mb = 512 is above \[limits\] max_memory_mb = 400",
        ),
        ({"pools": {"huge": {"limits": {"cpus": 1000}}}}, r"pools.huge.limits.cpus = 1000 is above"),
    ],
)
def test_bad_limits_settings_and_pools_above_them_are_config_errors(body, match):
    with pytest.raises(ConfigError, match=match):
        config.parse(body, "warmbox.toml", host=HOST)


def test_config_shows_the_limits_section(home):
    r = cli("config")
    assert r.returncode == 0, r.stderr
    assert "limits" in r.stdout and "max_memory_mb" in r.stdout and "MemTotal" in r.stdout
    r = cli("config", env={"WARMBOX_LIMITS__MAX_MEMORY_MB": "lots"})
    assert r.returncode != 0 and "WARMBOX_LIMITS__MAX_MEMORY_MB" in r.stderr and "Traceback" not in r.stderr


# ---- through the engine, SDK and CLI: refused before anything exists


def _user_state(engine: Engine) -> tuple[set[str], set[str]]:
    """(ids of non-pool sandbox rows, sandbox dirs not belonging to a pool's sandbox)."""
    rows = engine.list(include_dead=True)
    pooled = {i.sandbox_id for i in rows if i.pool}
    d = engine.runtime / "sandboxes"
    dirs = {p.name for p in d.iterdir()} if d.is_dir() else set()
    return {i.sandbox_id for i in rows if not i.pool}, dirs - pooled


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_create_refuses_absurd_limits_before_anything_exists(home, tier):
    engine = Engine.for_home(home)
    before = _user_state(engine)
    for field, limits in ABSURD:
        for pool in (True, False):
            with pytest.raises(LimitTooHigh, match=f"limits.{field}"):
                asyncio.run(provision.create(engine, tier=tier, limits=limits, pool=pool))
        with pytest.raises(LimitTooHigh):
            Sandbox.create(tier=tier, limits=limits)
    assert _user_state(engine) == before
    r = cli("create", "--tier", tier, "--memory", str(10**9))
    assert r.returncode != 0 and "limits.memory_mb" in r.stderr and "Traceback" not in r.stderr
    assert _user_state(engine) == before


@pytest.mark.sandbox
def test_a_config_max_is_honoured_and_normal_limits_still_create(home, runc_ready):
    engine = Engine.for_home(home)
    set_config(home, "\n[limits]\nmax_memory_mb = 600\nmax_pids = 400\n")
    try:
        before = _user_state(engine)
        with pytest.raises(
            LimitTooHigh,
            match=r"memory_mb = 700 is above \[limits\] max_memory_mb = 600 MiB "
            r"\(.*warmbox\.toml \[limits\] max_memory_mb\)",
        ):
            Sandbox.create(limits=Limits(memory_mb=700), timeout=60)
        with pytest.raises(LimitTooHigh, match="max_pids = 400"):
            Sandbox.create(limits=Limits(pids=401), timeout=60)
        assert _user_state(engine) == before
        with Sandbox.create(limits=Limits(memory_mb=600, pids=400, cpus=0.5, tmp_mb=64), timeout=60) as sb:
            r = sb.commands.run("df -m /tmp | tail -1; cat /sys/fs/cgroup/pids.max 2>/dev/null || true")
            assert r.exit_code == 0 and " 64 " in r.stdout, r.stdout
    finally:
        set_config(home)


@pytest.mark.sandbox
@pytest.mark.parametrize("tier,memory", [("container", False), ("gvisor", True)])
def test_resume_and_fork_refuse_limits_above_a_lowered_max(home, runc_ready, tier, memory):
    """A snapshot taken under generous maxima cannot come back above the maxima of now."""
    engine = Engine.for_home(home)
    sb = Sandbox.create(tier=tier, limits=Limits(memory_mb=640), template="shell", timeout=120)
    try:
        sb.files.write("/workspace/kept.txt", "here")
        ref = sb.pause(memory=memory)
        set_config(home, "\n[limits]\nmax_memory_mb = 600\n")
        before = _user_state(engine)
        with pytest.raises(LimitTooHigh, match=r"limits\.memory_mb = 640 is above \[limits\] max_memory_mb = 600"):
            Sandbox.resume(sb.sandbox_id, timeout=60)
        with pytest.raises(LimitTooHigh, match=r"limits\.memory_mb = 640"):
            Sandbox.create(from_snapshot=ref, timeout=60)
        assert _user_state(engine) == before
        assert engine.info(sb.sandbox_id)[0].state is State.PAUSED  # still resumable
        set_config(home)
        with Sandbox.resume(sb.sandbox_id, timeout=60) as back:
            assert back.files.read("/workspace/kept.txt") == "here"
    finally:
        set_config(home)
        if engine.info(sb.sandbox_id)[0].state is not State.DESTROYED:  # paused, or the pause failed
            asyncio.run(teardown.destroy(engine, sb.sandbox_id, "test cleanup"))
