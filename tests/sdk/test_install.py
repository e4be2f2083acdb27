"""A sandbox agents can install into, on every tier: pip into the sandbox's venv, npm into the
workspace or a user prefix, git commits with a default identity, and, without network, downloads
that fail at once saying so. With an egress policy the same tools go through the proxy (the fake
internet of tests/network, never a real one)."""

from __future__ import annotations

import io
import json
import tarfile
import time
import zipfile

import pytest

from tests.network.conftest import net_home, world  # noqa: F401  (fixtures: the fake internet)
from warmbox import BackendUnavailable, Network, Sandbox
from warmbox.guest import userenv

pytestmark = pytest.mark.sandbox
OFFLINE_S = 5.0  # a download without network fails this soon after the tool started (npm used to retry for 70 s)
TIERS = ("container", "gvisor", "microvm")


def wheel(name: str, value: int) -> bytes:
    """A pure-Python wheel of module ``name`` with ``VALUE = value``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VALUE = {value}\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(
            f"{name}-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: wbt\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return buf.getvalue()


def npm_tarball(name: str) -> bytes:
    """What ``npm pack`` makes of a one-file package ``name`` with a command of the same name."""
    files = {
        "package/package.json": json.dumps(
            {"name": name, "version": "1.0.0", "main": "index.js", "bin": {name: "cli.js"}}
        ).encode(),
        "package/index.js": b"module.exports = (s) => '[' + s + ']';\n",
        "package/cli.js": b"#!/usr/bin/env node\nconsole.log(require('./index.js')('cli'));\n",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755 if path.endswith("cli.js") else 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def open_tier(tier: str) -> Sandbox:
    try:
        return Sandbox.create(tier=tier, timeout=600)
    except BackendUnavailable as e:
        pytest.skip(f"the {tier} tier is not available here: {e}")


@pytest.mark.parametrize("tier", TIERS)
def test_pip_npm_and_git_work_without_network(home, runc_ready, tier):
    with open_tier(tier) as sb:
        r = sb.commands.run("command -v python pip; echo $VIRTUAL_ENV")
        assert r.stdout.split() == [f"{userenv.VENV}/bin/python", f"{userenv.VENV}/bin/pip", userenv.VENV], r.stderr
        # pip into the venv, no --break-system-packages; a code context imports it, beside NumPy
        sb.files.write("/tmp/wbtlocal-1.0-py3-none-any.whl", wheel("wbtlocal", 7))
        r = sb.commands.run("pip install -q --no-index /tmp/wbtlocal-1.0-py3-none-any.whl", timeout=120)
        assert r.exit_code == 0, r.stderr
        e = sb.run_code("import wbtlocal, numpy, sys; (wbtlocal.VALUE, sys.prefix, wbtlocal.__file__)")
        assert e.error is None, e.error
        assert e.text == repr((7, userenv.VENV, f"{userenv.VENV}/lib/python3.11/site-packages/wbtlocal/__init__.py"))
        # npm: into a project, and -g into the user's prefix (its command on PATH). Not on the microVM
        # tier: node under TCG costs ~50 s of CI here, and npm, its config and the proxy variables are
        # the same image's on every tier (the microVM run still checks pip, git and curl offline)
        node = tier != "microvm"
        if node:
            sb.files.write("/tmp/wbt-pad-1.0.0.tgz", npm_tarball("wbt-pad"))
            r = sb.commands.run(
                "mkdir /workspace/app && cd /workspace/app"
                " && npm install -s --no-audit --no-fund /tmp/wbt-pad-1.0.0.tgz"
                ' && node -e \'console.log(require("wbt-pad")("x"))\''
                " && npm install -g -s --no-audit --no-fund /tmp/wbt-pad-1.0.0.tgz && wbt-pad && command -v wbt-pad",
                timeout=180,
            )
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split() == ["[x]", "[cli]", f"{userenv.NPM_PREFIX}/bin/wbt-pad"]
        # git: a commit needs no identity set up
        r = sb.commands.run(
            "cd /workspace && git init -q repo && cd repo && echo hi > a && git add a && git commit -qm first"
            " && git log --format='%an <%ae>|%s' && git branch --show-current"
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == ["warmbox sandbox <sandbox@warmbox.invalid>|first", "main"]
        # a server of the sandbox's own stays reachable through the tools that honour the proxy variables
        r = sb.commands.run(
            "cd /tmp && (python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 &) && sleep 0.2"
            " && for i in $(seq 100); do curl -sf -o /dev/null http://localhost:8765/ && break; sleep 0.1; done"
            " && curl -sS -o /dev/null -w '%{http_code} ' http://127.0.0.1:8765/"
            " && python3 -c \"import urllib.request as u; print(u.urlopen('http://localhost:8765/').status)\"",
            timeout=60,
        )
        assert r.stdout.split() == ["200", "200"], r.stderr
        # no network: every download fails at once and says why: within a few seconds of what the
        # tool costs anyway (its --version: npm alone takes 10 s to start on the microVM tier's TCG)
        for cmd, says in (
            ("pip install -q wbt-not-here", "no network: this sandbox's network policy is none"),
            ("npm view wbt-not-here version", "no-network.sandbox-policy-is-none.invalid"),
            ("curl -sS https://example.test/", "Could not resolve proxy: no-network.sandbox-policy-is-none.invalid"),
            ("git ls-remote https://example.test/r.git", "no-network.sandbox-policy-is-none.invalid"),
        ):
            if cmd.startswith("npm") and not node:
                continue
            t0 = time.monotonic()
            assert sb.commands.run(cmd.split()[0] + " --version", timeout=120).exit_code == 0
            t1 = time.monotonic()
            r = sb.commands.run(cmd, timeout=120)
            t2 = time.monotonic()
            assert r.exit_code != 0 and says in r.stderr + r.stdout, (cmd, r.stdout, r.stderr)
            assert t2 - t1 < 2 * (t1 - t0) + OFFLINE_S, f"{cmd}: {t2 - t1:.1f} s (--version: {t1 - t0:.1f} s)"


def test_installed_packages_survive_pause_and_resume(home, runc_ready):
    with Sandbox.create(tier="container", timeout=600) as sb:
        sb.files.write("/tmp/wbtkeep-1.0-py3-none-any.whl", wheel("wbtkeep", 5))
        assert sb.commands.run("pip install -q --no-index /tmp/wbtkeep-1.0-py3-none-any.whl").exit_code == 0
        sb.pause()
        back = Sandbox.resume(sb.sandbox_id)
        try:
            assert back.commands.run("python -c 'import wbtkeep; print(wbtkeep.VALUE)'").stdout == "5\n"
            assert back.run_code("import wbtkeep; wbtkeep.VALUE").text == "5"
        finally:
            back.kill()


@pytest.mark.in_process("the fake internet is wired into an in-process home")
def test_pip_and_npm_install_through_the_egress_proxy(net_home, world):  # noqa: F811
    site = world.dir / "site"
    (site / "npm").mkdir(exist_ok=True)
    (site / "npm" / "wbt-pad-1.0.0.tgz").write_bytes(npm_tarball("wbt-pad"))
    (site / "npm" / "wbt-pad").write_text(
        json.dumps(
            {
                "name": "wbt-pad",
                "dist-tags": {"latest": "1.0.0"},
                "versions": {
                    "1.0.0": {
                        "name": "wbt-pad",
                        "version": "1.0.0",
                        "bin": {"wbt-pad": "cli.js"},
                        "dist": {"tarball": "http://allowed.test/npm/wbt-pad-1.0.0.tgz"},
                    }
                },
            }
        )
    )
    world.clear_logs()
    with Sandbox.create(network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
        # plain HTTP: the fake site's certificate is of a test CA the sandbox does not trust
        r = sb.commands.run(
            "pip install -q --index-url http://allowed.test/simple/ --trusted-host allowed.test wbtpkg", timeout=120
        )
        assert r.exit_code == 0, r.stderr
        e = sb.run_code("import wbtpkg; wbtpkg.VALUE")
        assert e.error is None and e.text == "42", e.error
        r = sb.commands.run(
            "mkdir /workspace/app && cd /workspace/app && npm install -s --no-audit --no-fund"
            ' --registry http://allowed.test/npm/ wbt-pad && node -e \'console.log(require("wbt-pad")("y"))\'',
            timeout=180,
        )
        assert r.exit_code == 0 and r.stdout.strip() == "[y]", r.stderr
    paths = {rec["path"] for rec in world.log("allowed")}
    assert {"/simple/wbtpkg/", "/packages/wbtpkg-1.0-py3-none-any.whl", "/npm/wbt-pad"} <= paths, paths
