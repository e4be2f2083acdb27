"""E2B's domain mode: ``E2B_DOMAIN`` set (no E2B_API_URL, no E2B_SANDBOX_URL), so the official SDK
calls ``https://api.{domain}`` and ``https://{port}-{sandboxID}.{domain}``, and ``get_host(port)``
reaches a web server inside the sandbox.

All of it inside a network namespace this test makes (/work/shared/testnet.md): dnsmasq answers the
wildcard ``*.e2b.test`` with the namespace's own loopback, a TLS listener on its 127.0.0.1:443 (a
certificate of a test CA, given to Python by SSL_CERT_FILE and to Node by NODE_EXTRA_CA_CERTS)
relays each connection to the lane's warmbox serve, as a deployment's TLS proxy in front of it
would; the SDK clients run in the namespace (``ip netns exec``, which gives them its resolv.conf).
Nothing leaves the machine: the namespace has only its loopback."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import datetime
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
pytest.importorskip("e2b_code_interpreter", reason="the e2b extra (pip install -e '.[e2b]')")

DOMAIN = "e2b.test"
NODE_MODULES = Path(__file__).resolve().parent / "node_modules"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _test_ca(where: Path) -> tuple[Path, Path, Path]:
    """A test CA and a certificate of ``*.e2b.test`` it signed: (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmbox e2b test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"*.{DOMAIN}")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"*.{DOMAIN}")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (where / "ca.pem", where / "cert.pem", where / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def _listen_in(netns: str, port: int) -> socket.socket:
    """A TCP listener on 127.0.0.1:``port`` of the named namespace (this thread enters it to make
    the socket, then comes back: the socket stays there)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the test namespace")
        try:
            sock = socket.create_server(("127.0.0.1", port))
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)
    return sock


class _TlsRelay:
    """TLS on the namespace's 127.0.0.1:443, each connection relayed (bytes, unchanged: the Host
    header included) to the lane's server on the host's loopback."""

    def __init__(self, listener: socket.socket, cert: Path, key: Path, upstream: tuple[str, int]) -> None:
        self._listener = listener
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self._upstream = upstream
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(30)
            client = self._ctx.wrap_socket(raw, server_side=True)
            client.settimeout(None)
            up = socket.create_connection(self._upstream, timeout=30)
            up.settimeout(None)
        except OSError:
            raw.close()
            return
        with self._lock:
            self._conns += [client, up]
        t = threading.Thread(target=self._pipe, args=(up, client), daemon=True)
        t.start()
        self._pipe(client, up)
        t.join()
        client.close()
        up.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
        self._listener.close()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.close()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def domain_net(e2b_server, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The namespace, its dnsmasq and TLS relay; yields what a client in it needs: the command
    prefix's namespace name and the environment (E2B_DOMAIN, the CA for Python and Node). All
    removed after, even on failure."""
    if os.geteuid() != 0 or not shutil.which("dnsmasq"):
        pytest.skip("domain mode's test needs root and dnsmasq (scripts/bootstrap installs dnsmasq-base)")
    work = tmp_path_factory.mktemp("e2b-domain")
    ca, cert, key = _test_ca(work)
    name = f"wbt-{secrets.token_hex(3)}-e2b"
    etc = Path("/etc/netns") / name
    dnsmasq: subprocess.Popen[bytes] | None = None
    relay: _TlsRelay | None = None
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        etc.mkdir(parents=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n")
        dnsmasq = subprocess.Popen(
            [
                "ip", "netns", "exec", name, "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
                "--listen-address=127.0.0.1", "--bind-interfaces", "--user=root", "--pid-file=",
                f"--address=/{DOMAIN}/127.0.0.1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        host, port = e2b_server.server.url.removeprefix("http://").rsplit(":", 1)
        relay = _TlsRelay(_listen_in(name, 443), cert, key, (host, int(port)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(
            E2B_DOMAIN=DOMAIN,
            E2B_API_KEY=e2b_server.key_a,
            KEY_B=e2b_server.key_b,
            SSL_CERT_FILE=str(ca),
            NODE_EXTRA_CA_CERTS=str(ca),
        )
        yield {"netns": name, **env}
    finally:
        if relay is not None:
            relay.close()
        if dnsmasq is not None:
            dnsmasq.terminate()
            dnsmasq.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(etc, ignore_errors=True)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# the server inside the sandbox: answers what it was sent (path and headers)
ECHO = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.path + "\\n" + "".join(f"{k.lower()}: {v}\\n" for k, v in self.headers.items())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""

PY_CLIENT = r"""
import sys, time
import httpx
from e2b_code_interpreter import Sandbox

sb = Sandbox.create(timeout=120)
try:
    print("api", sb.sandbox_domain, sb.sandbox_id)
    sb.files.write("echo.py", sys.argv[2])
    print("cmd", sb.commands.run("wc -l < echo.py").stdout.strip())
    sb.commands.run("exec python3 echo.py", background=True)
    host = sb.get_host(8000)
    print("host", host)
    token = {"e2b-traffic-access-token": sb.traffic_access_token, "x-mine": "kept"}
    for _ in range(100):
        r = httpx.get(f"https://{host}/some/path?q=1", headers=token)
        if r.status_code != 502:
            break
        time.sleep(0.1)
    print("port", r.status_code, repr(r.text))
    print("anon", httpx.get(f"https://{host}/").status_code)
    print("other", httpx.get(f"https://{host}/", headers={"x-api-key": sys.argv[1]}).status_code)
    print("code", sb.run_code("print(6 * 7)").logs.stdout)
    missing = host.replace(sb.sandbox_id, "sb-000000000000")
    print("gone", httpx.get(f"https://{missing}/", headers=token).status_code)
    # signed file URLs: the URL alone is the credential, for its path, operation and time
    up = sb.upload_url("up/new.txt")
    r = httpx.post(up, files={"file": ("/home/user/echo.py", b"uploaded")})  # the part's name is not the path
    print("upload", r.status_code, sb.files.read("up/new.txt"), sb.files.read("echo.py") == sys.argv[2])
    print("download", httpx.get(sb.download_url("up/new.txt", use_signature_expiration=60)).text)
    print("as_write", httpx.post(sb.download_url("up/new.txt"), files={"file": ("x", b"x")}).status_code)
    print("other_path", httpx.get(sb.download_url("up/new.txt").replace("new.txt", "..%2Fecho.py")).status_code)
    from e2b.sandbox.signature import get_signature
    old = get_signature("up/new.txt", "read", None, sb._envd_access_token, -5)
    print("expired", httpx.get(sb._file_url("up/new.txt", None, old["signature"], old["expiration"])).status_code)
    print("forged", httpx.get(sb._file_url("up/new.txt", None, "v1_" + "A" * 43)).status_code)
finally:
    sb.kill()
print("done")
"""


def _client(net: dict[str, str], argv: list[str], timeout: float = 180) -> str:
    env = {k: v for k, v in net.items() if k != "netns"}
    r = subprocess.run(
        ["ip", "netns", "exec", net["netns"], *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def test_python_sdk_in_domain_mode_with_tls(domain_net, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(PY_CLIENT)
    out = _client(domain_net, [sys.executable, str(script), domain_net["KEY_B"], ECHO])
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["api"].startswith(f"{DOMAIN} sb-")
    assert lines["cmd"] == str(ECHO.count("\n"))
    assert lines["host"].startswith("8000-sb-") and lines["host"].endswith(f".{DOMAIN}")
    status, _, seen = lines["port"].partition(" ")
    assert status == "200", seen  # get_host reached the server in the sandbox
    seen = ast.literal_eval(seen)  # the repr of what it answered: the request it got
    assert seen.startswith("/some/path?q=1\n") and "x-mine: kept\n" in seen
    assert "token" not in seen and "e2b-" not in seen and "x-api-key" not in seen  # credentials stay out
    assert lines["anon"] == "401"  # no token, no key: no port
    assert lines["other"] == "404"  # another tenant's key: not found
    assert lines["code"] == "['42\\n']"
    assert lines["gone"] == "401"  # the token is bound to its sandbox
    assert lines["upload"] == "200 uploaded True"  # written to the signed path, nowhere else
    assert lines["download"] == "uploaded"
    assert lines["as_write"] == lines["other_path"] == lines["expired"] == lines["forged"] == "401"
    assert "done" in out


JS_CLIENT = r"""
import { Sandbox } from '@e2b/code-interpreter'

const [keyB, echo] = process.argv.slice(2)
const sb = await Sandbox.create({ timeoutMs: 120_000 })
try {
  console.log('api', sb.sandboxDomain, sb.sandboxId)
  await sb.files.write('echo.py', echo)
  await sb.commands.run('exec python3 echo.py', { background: true })
  const host = sb.getHost(8000)
  console.log('host', host)
  const token = { 'e2b-traffic-access-token': sb.trafficAccessToken, 'x-mine': 'kept' }
  let r
  for (let i = 0; i < 100; i++) {
    r = await fetch(`https://${host}/js?q=2`, { headers: token })
    if (r.status !== 502) break
    await new Promise((ok) => setTimeout(ok, 100))
  }
  console.log('port', r.status, JSON.stringify(await r.text()))
  console.log('anon', (await fetch(`https://${host}/`)).status)
  console.log('other', (await fetch(`https://${host}/`, { headers: { 'x-api-key': keyB } })).status)
  console.log('code', JSON.stringify((await sb.runCode('print(6 * 7)')).logs.stdout))
  const form = new FormData()
  form.append('file', new Blob(['from js']), 'js.txt')
  const put = await fetch(await sb.uploadUrl('js.txt', { useSignatureExpiration: 60 }), { method: 'POST', body: form })
  console.log('upload', put.status, await sb.files.read('js.txt'))
  console.log('download', await (await fetch(await sb.downloadUrl('js.txt'))).text())
} finally {
  await sb.kill()
}
console.log('done')
"""


def test_javascript_sdk_in_domain_mode_with_tls(domain_net, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node, "Node.js is needed (scripts/bootstrap installs it)"
    assert (NODE_MODULES / "@e2b" / "code-interpreter").is_dir(), "scripts/bootstrap install (npm install in tests/e2b)"
    (tmp_path / "client.mjs").write_text(JS_CLIENT)
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)
    out = _client(domain_net, [node, str(tmp_path / "client.mjs"), domain_net["KEY_B"], ECHO])
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["api"].startswith(f"{DOMAIN} sb-")
    assert lines["host"].startswith("8000-sb-") and lines["host"].endswith(f".{DOMAIN}")
    status, _, seen = lines["port"].partition(" ")
    assert status == "200", seen
    seen = json.loads(seen)
    assert seen.startswith("/js?q=2\n") and "x-mine: kept\n" in seen
    assert "token" not in seen and "e2b-" not in seen and "x-api-key" not in seen
    assert lines["anon"] == "401"
    assert lines["other"] == "404"
    assert lines["code"] == '["42\\n"]'
    assert lines["upload"] == "200 from js"
    assert lines["download"] == "from js"
    assert "done" in out
