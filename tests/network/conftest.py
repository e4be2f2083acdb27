"""A fake internet in network namespaces this session creates (see ../shared/testnet.md).

    sandbox ──veth── egress netns (warmbox's) ◄─ proxy ─► wbt-<id>-up ──veth── wbt-<id>-world
                                                         192.0.2.1/24          192.0.2.2/24 + servers

The proxy's upstream namespace (``network.upstream_netns``) routes only into the world
namespace; nothing here has a route to the machine's real uplink.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from warmbox.engine import teardown

HERE = Path(__file__).resolve().parent
ALLOWED, ATTACKER, METADATA = "198.51.100.10", "203.0.113.66", "169.254.169.254"
ZONE = {
    "allowed.test": ALLOWED,
    "api.test": ALLOWED,
    "attacker.example.com": ATTACKER,
    "metadata.test": METADATA,
    "rebind.test": ALLOWED,
}


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _make_ca(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wbt fake-internet CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name, hosts in (
        ("allowed", ["allowed.test", "api.test", "rebind.test"]),
        ("attacker", ["attacker.example.com"]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (d / f"{name}.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            + cert.public_bytes(serialization.Encoding.PEM)
        )


def _make_site(site: Path) -> None:
    site.mkdir()
    (site / "hello.txt").write_text("hello from the allowed site\n")
    # a one-file package index (PEP 503) with a real wheel, for `pip download`
    wheel = "wbtpkg-1.0-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("wbtpkg/__init__.py", "VALUE = 42\n")
        z.writestr("wbtpkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: wbtpkg\nVersion: 1.0\n")
        z.writestr(
            "wbtpkg-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: wbt\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("wbtpkg-1.0.dist-info/RECORD", "")
    (site / "packages").mkdir()
    (site / "packages" / wheel).write_bytes(buf.getvalue())
    (site / "simple" / "wbtpkg").mkdir(parents=True)
    (site / "simple" / "index.html").write_text('<a href="wbtpkg/">wbtpkg</a>\n')
    (site / "simple" / "wbtpkg" / "index.html").write_text(f'<a href="/packages/{wheel}">{wheel}</a>\n')
    # a git repository served over dumb HTTP
    work = site.parent / "repo-work"
    work.mkdir()
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "HOME": str(site.parent),
    }
    for argv in (["git", "init", "-q", "-b", "main", str(work)],):
        subprocess.run(argv, check=True, env=env)
    (work / "README").write_text("cloned through the warmbox proxy\n")
    subprocess.run(["git", "-C", str(work), "add", "README"], check=True, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "init"], check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(site / "repo.git")], check=True, env=env)
    subprocess.run(["git", "-C", str(site / "repo.git"), "update-server-info"], check=True, env=env)


class World:
    def __init__(self, tag: str, d: Path) -> None:
        self.tag, self.dir = tag, d
        self.world, self.up = f"wbt-{tag}-world", f"wbt-{tag}-up"
        self.pid = 0

    def log(self, server: str) -> list[dict]:
        p = self.dir / f"{server}.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def clear_logs(self) -> None:
        for p in self.dir.glob("*.jsonl"):
            p.unlink()

    def set_zone(self, **names: str) -> None:
        zone = dict(ZONE)
        zone.update({k.replace("_", "."): v for k, v in names.items()})
        (self.dir / "zone.json").write_text(json.dumps(zone))


@pytest.fixture(scope="session")
def world():
    tag = secrets.token_hex(3)
    d = Path(f"/tmp/wbt-net-{tag}")
    d.mkdir(mode=0o755)
    w = World(tag, d)
    _make_ca(d)
    _make_site(d / "site")
    w.set_zone()
    try:
        _sh("ip", "netns", "add", w.world)
        _sh("ip", "netns", "add", w.up)
        _sh(
            "ip",
            "link",
            "add",
            f"wbt{tag}u",
            "netns",
            w.up,
            "type",
            "veth",
            "peer",
            "name",
            f"wbt{tag}w",
            "netns",
            w.world,
        )
        for ns, dev, addr in ((w.up, f"wbt{tag}u", "192.0.2.1/24"), (w.world, f"wbt{tag}w", "192.0.2.2/24")):
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", w.up, "route", "add", "default", "via", "192.0.2.2")  # into the fake world only
        for a in (ALLOWED, ATTACKER, METADATA):
            _sh("ip", "-n", w.world, "addr", "add", f"{a}/32", "dev", "lo")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", w.world, sys.executable, str(HERE / "fakeworld.py"), str(d)],
            stdout=subprocess.DEVNULL,
            stderr=open(d / "fakeworld.err", "wb"),
        )
        w.pid = proc.pid
        deadline = time.monotonic() + 20
        while not (d / "ready").exists():
            assert proc.poll() is None, (d / "fakeworld.err").read_text()
            assert time.monotonic() < deadline, "fake world did not start"
            time.sleep(0.05)
        yield w
    finally:
        if w.pid:
            try:
                os.kill(w.pid, 15)
                os.waitpid(w.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for ns in (w.world, w.up):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)
    left = [n for n in os.listdir("/run/netns") if n.startswith(f"wbt-{tag}")] if os.path.isdir("/run/netns") else []
    assert not left, f"test namespaces left: {left}"


@contextlib.contextmanager
def a_net_home(world, name: str, approval_timeout: float):
    """A warmbox home at /tmp/``name`` whose proxy gets out only into the fake world."""
    from warmbox.engine import egress
    from warmbox.engine.daemon import down_home
    from warmbox.engine.engine import Engine
    from warmbox.network import netns

    path = Path(f"/tmp/{name}")
    path.mkdir(mode=0o700)
    (path / "warmbox.toml").write_text(f"""
[daemon]
idle_exit = 3

[pools]

[network]
upstream_netns = "{world.up}"
upstream_dns = ["192.0.2.2"]
upstream_ca = "{world.dir / "ca.pem"}"
approval_timeout = {approval_timeout}
""")
    try:
        yield path
    finally:
        engine = Engine.for_home(path)
        for info in engine.list():
            asyncio.run(teardown.destroy(engine, info.sandbox_id, "test teardown"))
        asyncio.run(down_home(path))
        egress_ns = netns.egress_name(engine.runtime)
        proxy_left = egress.proxy_pid(path)
        ns_left = os.path.exists(netns.netns_path(egress_ns))
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(engine.runtime, ignore_errors=True)
    assert proxy_left is None, "the egress proxy outlived `warmbox down`"
    assert not ns_left, f"egress namespace {egress_ns} left"


@pytest.fixture(scope="session")
def net_home(world, runc_ready):
    """A warmbox home whose proxy gets out only into the fake world (approval_timeout 5 s)."""
    with a_net_home(world, f"wbt-n{world.tag}", 5) as path:
        yield path
