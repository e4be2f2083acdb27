"""`warmbox serve` with TLS: a self-signed certificate made by the test, the SDK verifying it
(SSL_CERT_FILE), and the refusal of a clear-text listener off loopback."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli
from tests.server.test_mcp_http import start_server, stop_server


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_serve_refuses_clear_text_off_loopback(tmp_path: Path) -> None:
    r = cli("serve", "--host", "0.0.0.0", "--port", "0", "--socket", "-", env={"WARMBOX_HOME": str(tmp_path)})
    assert r.returncode == 125 and "without TLS" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.sandbox
def test_sdk_over_tls(home: Path, runc_ready: None, tmp_path: Path) -> None:
    from warmbox.engine.engine import Engine

    cert, key = _self_signed(tmp_path)
    _, secret = Engine.for_home(home).registry.tenants.create_key("tls-tenant")
    proc, base = start_server(home, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert base.startswith("https://127.0.0.1:")
        script = (
            "from warmbox import Sandbox\n"
            f"with Sandbox.create(api_url={base!r}, api_key={secret!r}) as sb:\n"
            "    print(sb.commands.run('echo over-tls').stdout.strip())\n"
        )
        env = {**os.environ, "SSL_CERT_FILE": str(cert)}
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "over-tls", r.stderr
        # without the certificate trusted the client refuses the server: a typed error, no traceback
        env.pop("SSL_CERT_FILE")
        r = cli("--api-url", base, "--api-key", secret, "ls", env={"SSL_CERT_FILE": "/nonexistent"})
        assert r.returncode == 125 and "TLS with" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        stop_server(proc)
