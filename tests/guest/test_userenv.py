"""The install locations the agent makes at boot (guest/userenv.py), checked without a sandbox."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from warmbox.engine.egress import proxy_env
from warmbox.guest import userenv

GUEST_PYTHON = "/usr/bin/python3"  # the interpreter the container and gVisor images run (the host's /usr)


@pytest.mark.skipif(not Path(GUEST_PYTHON).exists(), reason="no /usr/bin/python3")
def test_hand_made_venv_is_a_venv_with_pip(tmp_path: Path):
    venv = tmp_path / "venv"
    userenv.make_venv(str(venv), GUEST_PYTHON)
    out = subprocess.run(
        [str(venv / "bin/python"), "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == str(venv) and out[1] != str(venv)  # a venv: pip installs there, PEP 668 does not apply
    r = subprocess.run([str(venv / "bin/pip"), "--version"], capture_output=True, text=True)
    if "No module named pip" in r.stderr:
        pytest.skip("the host's /usr/bin/python3 has no pip (python3-pip)")
    assert r.returncode == 0 and "pip " in r.stdout, r.stderr


def test_setup_puts_the_venv_first_and_keeps_what_is_set(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(userenv, "VENV", str(tmp_path / "venv"))
    env = {"HOME": "/home/user", "PATH": "/usr/bin:/bin", "HTTPS_PROXY": "http://mine:3128"}
    userenv.setup(env)
    assert env["PATH"] == f"{tmp_path}/venv/bin:{userenv.NPM_PREFIX}/bin:/usr/bin:/bin"
    assert env["VIRTUAL_ENV"] == f"{tmp_path}/venv" and userenv.python(env) == f"{tmp_path}/venv/bin/python3"
    assert env["HTTPS_PROXY"] == "http://mine:3128"  # the caller's own value stays
    assert env["https_proxy"] == userenv.OFFLINE_PROXY
    userenv.setup(env)  # again (a restored sandbox): nothing doubled
    assert env["PATH"].count("/venv/bin") == 1
    other = {"HOME": "/root", "PATH": "/usr/bin"}
    userenv.setup(other)  # not the sandbox user's home: untouched
    assert other == {"HOME": "/root", "PATH": "/usr/bin"}


def test_linking_egress_overrides_every_offline_default():
    assert set(userenv.OFFLINE_ENV) <= set(proxy_env({}, ca=False))
