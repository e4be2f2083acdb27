"""A typo in warmbox.toml while `warmbox serve` runs (issue 34): the server keeps serving on its last
good settings and says so (its log says why, /readyz that it does); `warmbox config` and `warmbox ls`
say what is wrong; a typo in a limits table lists the keys there are."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import cli, start_server, wait_for
from warmbox.config import parse
from warmbox.engine import teardown
from warmbox.engine.engine import Engine
from warmbox.errors import ConfigError

GOOD = "[daemon]\nidle_exit = 2\n[pools]\n"  # no pool: nothing is warmed in this home
TYPO = GOOD + "[defaults]\ntimeuot = 60\n"


def _write(path: Path, text: str) -> None:
    """Replace the file so that a reader's (mtime, size) stamp sees the change."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns <= old:
        os.utime(path, ns=(st.st_atime_ns, old + 1_000_000))


def _readyz(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/readyz", timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.mark.sandbox
@pytest.mark.in_process("runs its own warmbox serve on a home of its own")
def test_a_typo_while_serving_keeps_the_last_good_settings_and_is_reported(runc_ready):
    h = Path(f"/tmp/wbcfg-{secrets.token_hex(3)}")
    h.mkdir(mode=0o700)
    _write(h / "warmbox.toml", GOOD)
    engine = Engine(h)
    server = start_server(h)
    try:
        _key_id, secret = engine.registry.tenants.create_key("cfg")
        remote = {"WARMBOX_API_URL": server.url, "WARMBOX_API_KEY": secret}
        local = {"WARMBOX_HOME": str(h), "WARMBOX_API_URL": "", "WARMBOX_API_KEY": ""}
        r = cli("create", "--timeout", "120", env=remote)
        assert r.returncode == 0, r.stderr
        assert "config_error" not in _readyz(server.url)

        _write(h / "warmbox.toml", TYPO)
        r = cli("create", "--timeout", "120", env=remote)  # it answered config_error to every create
        assert r.returncode == 0, r.stderr
        ready = _readyz(server.url)  # anyone may ask: that there is an error, not the host's path or values
        assert ready["ok"] is True and "last good settings" in ready["config_error"]
        assert str(h) not in ready["config_error"]
        wait_for(lambda: "keeping the last good settings" in server.output(), 10, "the server to log it")
        assert "defaults.timeuot" in server.output()

        r = cli("config", env=local)
        assert r.returncode == 125 and "defaults.timeuot" in r.stderr and "last good settings" in r.stderr
        assert "Traceback" not in r.stderr
        r = cli("ls", env=local)  # it lists, and no longer in silence
        assert r.returncode == 0 and r.stdout.startswith("ID")
        assert "warning" in r.stderr and "defaults.timeuot" in r.stderr

        _write(h / "warmbox.toml", GOOD + "[defaults]\ntimeout = 60\n")
        assert "config_error" not in _readyz(server.url)  # fixed: taken, nothing to report
    finally:
        assert server.stop() == 0, server.output()
        from warmbox.engine.daemon import down_home

        asyncio.run(down_home(h))
        for info in engine.list(include_pooled=True):
            asyncio.run(teardown.destroy(engine, info.sandbox_id, "test cleanup"))
        shutil.rmtree(engine.runtime, ignore_errors=True)
        shutil.rmtree(h, ignore_errors=True)


def test_a_typo_in_a_limits_table_lists_the_keys_there_are():
    with pytest.raises(ConfigError, match=r"unknown key pools\.p\.limits\.memroy_mb \(known: cpus, disk_mb.*memory_mb"):
        parse({"pools": {"p": {"limits": {"memroy_mb": 512}}}}, "warmbox.toml")
    with pytest.raises(ConfigError, match=r"unknown key limits\.memroy_mb \(known: max_cpus.*max_memory_mb"):
        parse({"limits": {"memroy_mb": 512}}, "warmbox.toml")
    with pytest.raises(ConfigError, match=r"limits\.memory_mb: \[limits\] holds the most .*\(max_memory_mb = \.\.\.\)"):
        parse({"limits": {"memory_mb": 512}}, "warmbox.toml")
