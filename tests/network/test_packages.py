"""Installing packages inside a sandbox, as a newcomer does (issue 34, items 4-6), against the fake
internet of conftest.py: nothing leaves this machine.

- behind a TLS-intercepting upstream (the fake world's sites are signed by a CA only the test
  has), pip, curl, Python and node verify once ``[network] extra_ca`` names that CA;
- ``--allow pypi`` / ``Network(allow=["pypi"])`` reach the hosts pip needs, and a host package
  mirror (``[network] pip_index_url``) is used and reachable without being allowed by name;
- a refused connection says, in pip's and curl's own error output, which host, which rule, and
  how to allow it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmbox import Network, Sandbox

from .conftest import ALLOWED, _make_ca

pytestmark = pytest.mark.sandbox
WARMBOX = str(Path(sys.executable).with_name("warmbox"))
IMPORT = "python3 -c 'import wbtpkg; print(wbtpkg.VALUE)'"
# an HTTPS GET by node through the proxy (node's https module ignores HTTPS_PROXY), verified
# against node's default CAs: NODE_EXTRA_CA_CERTS is how extra_ca reaches them
NODE_GET = """
const http = require("http"), tls = require("tls");
const p = new URL(process.env.HTTPS_PROXY);
http.request({ host: p.hostname, port: p.port, method: "CONNECT", path: "allowed.test:443" })
  .on("connect", (res, sock) => {
    const s = tls.connect({ socket: sock, servername: "allowed.test" }, () =>
      s.write("GET /hello.txt HTTP/1.0\\r\\nHost: allowed.test\\r\\n\\r\\n"));
    s.on("data", (d) => process.stdout.write(d));
    s.on("error", (e) => { console.error(e.message); process.exit(1); });
  })
  .end();
"""
PIP = "python3 -m pip --disable-pip-version-check --no-input --retries 0 --timeout 15 "


def sh(sb, cmd: str, timeout: float = 120):
    return sb.commands.run(["/bin/bash", "-c", cmd], timeout=timeout)


@contextlib.contextmanager
def network_settings(home: Path, **values: str):
    """``home``'s warmbox.toml with these ``[network]`` keys added (its last table), restored after;
    the engine reads the file again when it changes."""
    toml = home / "warmbox.toml"
    before = toml.read_text()
    assert before.rstrip().splitlines()[-1].startswith("approval_timeout"), "[network] must be the last table"
    toml.write_text(before + "".join(f'{k} = "{v}"\n' for k, v in values.items()))
    try:
        yield
    finally:
        toml.write_text(before)


def test_extra_ca_lets_every_tool_verify_an_intercepting_upstream(net_home, world):
    # the fake world's TLS sites are signed by a CA the host's system store lacks, as an
    # intercepting upstream re-signs: without extra_ca, what the user saw in issue 34
    world.clear_logs()
    with Sandbox.create(network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
        r = sh(sb, f"{PIP} install --index-url https://allowed.test/simple wbtpkg")
        assert r.exit_code != 0 and "CERTIFICATE_VERIFY_FAILED" in r.stdout + r.stderr, r.stdout + r.stderr
        r = sh(sb, "curl -sS --max-time 8 https://allowed.test/hello.txt")
        assert r.exit_code == 60, r.stderr  # curl: peer certificate cannot be authenticated
    with network_settings(net_home, extra_ca=str(world.dir / "ca.pem")):
        with Sandbox.create(network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
            env = sh(sb, "env").stdout
            for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE"):
                assert f"{name}=/home/user/.warmbox/ca-bundle.pem\n" in env, env
            r = sh(
                sb,
                f"{PIP} install --index-url https://allowed.test/simple wbtpkg && {IMPORT}",
            )
            assert r.exit_code == 0 and r.stdout.strip().endswith("42"), r.stdout + r.stderr
            r = sh(sb, "curl -sS --max-time 8 https://allowed.test/hello.txt")
            assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
            r = sh(
                sb,
                "python3 -c \"import urllib.request; print(urllib.request.urlopen('https://allowed.test/hello.txt').read().decode())\"",
            )
            assert r.exit_code == 0 and "hello from the allowed site" in r.stdout, r.stderr
            # node's own TLS (what npm uses) with its default CAs, through the proxy's CONNECT
            sb.files.write("/tmp/get.js", NODE_GET)
            r = sh(sb, "node /tmp/get.js")
            assert r.exit_code == 0 and "hello from the allowed site" in r.stdout, r.stderr
            # the public CAs stay trusted: the bundle is the host's system store plus extra_ca
            bundle = sh(sb, "grep -c 'BEGIN CERTIFICATE' /home/user/.warmbox/ca-bundle.pem").stdout.strip()
            assert int(bundle) > 100, bundle
    paths = [e["path"] for e in world.log("allowed") if e["tls"]]
    assert "/packages/wbtpkg-1.0-py3-none-any.whl" in paths and "/hello.txt" in paths, paths


def test_doctor_names_the_host_cas_sandboxes_lack(tmp_path):
    # a host bundle with a CA beyond the distribution's set (this test's own) is reported, and
    # is not once extra_ca names it
    from warmbox.network.tls import host_only_cas

    packaged = tmp_path / "packaged"
    packaged.mkdir()
    _make_ca(tmp_path)
    bundle = tmp_path / "bundle.pem"
    bundle.write_text((tmp_path / "ca.pem").read_text())
    assert host_only_cas(bundle=str(bundle), packaged=str(packaged)) == ["CN=wbt fake-internet CA"]
    assert host_only_cas(str(tmp_path / "ca.pem"), bundle=str(bundle), packaged=str(packaged)) == []
    home = tmp_path / "home"
    home.mkdir()
    (home / "warmbox.toml").write_text(f'[network]\nextra_ca = "{tmp_path / "ca.pem"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMBOX_")}
    r = subprocess.run(
        [WARMBOX, "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "WARMBOX_HOME": str(home)},
    )
    tls = [line for line in r.stdout.splitlines() if line.startswith("tls")]
    assert len(tls) == 1, r.stdout + r.stderr
    # on a host whose own store has CAs of its own (this one's egress), they are named with the fix
    if host_only_cas(str(tmp_path / "ca.pem")):
        assert "warn" in tls[0] and "extra_ca" in tls[0], tls
    else:
        assert "sandboxes trust every CA the host does" in tls[0], tls


def test_allow_pypi_preset_from_the_sdk_and_the_cli(net_home, world):
    world.clear_logs()
    world.set_zone(pypi_org=ALLOWED, files_pythonhosted_org=ALLOWED)
    try:
        with Sandbox.create(network=Network(allow=["pypi"]), timeout=300, home=net_home) as sb:
            assert "pypi.org, files.pythonhosted.org" in sb.network.policy()
            r = sh(sb, f"{PIP} download -d /tmp/d --index-url http://pypi.org/simple --trusted-host pypi.org wbtpkg")
            assert r.exit_code == 0, r.stdout + r.stderr
            r = sh(sb, "curl -sS --max-time 8 http://files.pythonhosted.org/hello.txt")
            assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
            r = sh(sb, "curl -sS --max-time 8 http://allowed.test/hello.txt")
            assert "allowed.test:80 is not on the allowlist of this sandbox" in r.stdout, r.stdout  # nothing beyond it
        r = subprocess.run(
            [
                WARMBOX,
                "run",
                "--allow",
                "pypi",
                "--",
                "curl",
                "-sS",
                "--max-time",
                "8",
                "http://files.pythonhosted.org/hello.txt",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "WARMBOX_HOME": str(net_home)},
        )
        assert r.returncode == 0 and "hello from the allowed site" in r.stdout, r.stdout + r.stderr
        hosts = {e["headers"].get("Host") for e in world.log("allowed")}
        assert {"pypi.org", "files.pythonhosted.org"} <= hosts, hosts
    finally:
        world.set_zone()


def test_warmbox_toml_presets_and_the_host_package_mirror(net_home, world):
    world.clear_logs()
    world.set_zone(mirror_test=ALLOWED, internal_test=ALLOWED)
    toml = net_home / "warmbox.toml"
    before = toml.read_text()
    toml.write_text(
        before + 'pip_index_url = "http://mirror.test/simple"\n[network.presets]\ninternal = ["internal.test"]\n'
    )
    try:
        # allowed only allowed.test, yet pip installs from the mirror: its index is configured
        # and its host allowed in every sandbox with a network
        with Sandbox.create(network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
            r = sh(sb, f"{PIP} install wbtpkg && {IMPORT}")
            assert r.exit_code == 0 and r.stdout.strip().endswith("42"), r.stdout + r.stderr
        with Sandbox.create(network=Network(allow=["internal"]), timeout=300, home=net_home) as sb:
            r = sh(sb, "curl -sS --max-time 8 http://internal.test/hello.txt")
            assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        hosts = [e["headers"].get("Host") for e in world.log("allowed")]
        assert "mirror.test" in hosts and "internal.test" in hosts, hosts
    finally:
        toml.write_text(before)
        world.set_zone()


def test_a_refusal_says_which_host_which_rule_and_how_to_allow_it(net_home, world):
    world.clear_logs()
    with Sandbox.create(
        network=Network(allow=["allowed.test"], deny=["*.example.com"]), timeout=300, home=net_home
    ) as sb:
        # pip says why in its retry warnings (5 by default; one here)
        pip = PIP.replace("--retries 0", "--retries 1")
        r = sh(sb, f"{pip} download -d /tmp/d --index-url https://unlisted.test/simple wbtpkg")
        out = r.stdout + r.stderr
        assert r.exit_code != 0
        assert (
            "Tunnel connection failed: 403 Forbidden by warmbox: "
            "unlisted.test:443 is not on the allowlist of this sandbox" in out
        ), out
        assert 'Network(allow=[..., "unlisted.test"]) or warmbox run --allow unlisted.test' in out, out
        # a registry's host suggests its preset
        r = sh(sb, "curl -sSv --max-time 8 https://files.pythonhosted.org/x 2>&1")
        assert r.exit_code != 0
        assert "< HTTP/1.1 403 Forbidden by warmbox: files.pythonhosted.org:443 is not on" in r.stdout, r.stdout
        assert "warmbox run --allow pypi" in r.stdout, r.stdout
        # plain HTTP: curl prints the body, which says the same
        r = sh(sb, "curl -sS --max-time 8 http://attacker.example.com/")
        assert "matches the deny rule *.example.com" in r.stdout, r.stdout
    assert world.log("attacker") == [] and world.log("allowed") == []


@pytest.mark.parametrize("tier", ["gvisor", pytest.param("microvm", marks=pytest.mark.microvm)])
def test_extra_ca_on_the_other_tiers(net_home, world, tier):
    # the same bundle and env through each tier's link (gVisor's is made before runsc starts it)
    world.clear_logs()
    with network_settings(net_home, extra_ca=str(world.dir / "ca.pem")):
        with Sandbox.create(tier=tier, network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
            r = sh(sb, "curl -sS --max-time 20 https://allowed.test/hello.txt")
            assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
    assert [e["path"] for e in world.log("allowed") if e["tls"]] == ["/hello.txt"]


def test_template_build_allow_from_the_cli(net_home, world, tmp_path):
    """``warmbox template build Dockerfile --allow pypi`` (issue 34, item 9): the build's RUN step
    reaches the preset's hosts in the fake world (its server logs the request; curl -f fails the
    step otherwise); without --allow the build has no network."""
    from warmbox import InvalidArgument, Template
    from warmbox.cli.templates import with_allowed

    world.clear_logs()
    world.set_zone(files_pythonhosted_org=ALLOWED)
    token = os.urandom(6).hex()  # a step of its own: never a cached layer of an earlier run
    (tmp_path / "Dockerfile").write_text(
        f"FROM base\nRUN curl -sSf --max-time 8 http://files.pythonhosted.org/hello.txt > /etc/fetched-{token}\n"
    )
    name = f"t-allow-{token}"
    env = {**os.environ, "WARMBOX_HOME": str(net_home)}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([WARMBOX, *argv], capture_output=True, text=True, timeout=300, env=env)

    try:
        r = cli("template", "build", str(tmp_path / "Dockerfile"), "--name", name)
        assert r.returncode != 0 and "RUN curl" in r.stderr, r.stdout + r.stderr
        assert world.log("allowed") == []
        with pytest.raises(InvalidArgument, match="not a valid host name"):  # refused before anything is built
            with_allowed(Template.from_dockerfile(tmp_path / "Dockerfile"), ["no such host!"])
        r = cli("template", "build", str(tmp_path / "Dockerfile"), "--name", name, "--allow", "pypi")
        assert r.returncode == 0, r.stdout + r.stderr
        assert [e["headers"].get("Host") for e in world.log("allowed")] == ["files.pythonhosted.org"]
    finally:
        cli("template", "rm", name)
        world.set_zone()
