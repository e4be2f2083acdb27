"""Per-sandbox certificate authority for the hosts whose requests the proxy must rewrite.

Only the CA certificate enters the sandbox (so it trusts the proxy for those hosts); the keys
stay in the proxy's private directory and memory, and are removed with the sandbox's link.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
import warnings
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class SandboxCA:
    def __init__(self, sandbox_id: str, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"warmbox egress CA {sandbox_id}"))
            .issuer_name(_name(f"warmbox egress CA {sandbox_id}"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self._contexts: dict[str, ssl.SSLContext] = {}

    @property
    def cert_pem(self) -> str:
        return self._cert.public_bytes(serialization.Encoding.PEM).decode()

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` signed by this CA."""
        ctx = self._contexts.get(host)
        if ctx is not None:
            return ctx
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        path = self.dir / f"{len(self._contexts)}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            f.write(cert.public_bytes(serialization.Encoding.PEM))
            f.write(self._cert.public_bytes(serialization.Encoding.PEM))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(path)
        ctx.set_alpn_protocols(["http/1.1"])
        path.unlink()  # loaded; the key lives on in memory only
        self._contexts[host] = ctx
        return ctx

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PACKAGED_CAS = "/usr/share/ca-certificates"  # Debian's ca-certificates: the set the built-in image has too


def _certs(data: bytes) -> list[x509.Certificate]:
    try:
        with warnings.catch_warnings():  # a store's old CAs (serial 0) are read, not judged
            warnings.simplefilter("ignore")
            return x509.load_pem_x509_certificates(data)
    except ValueError:
        return []


def host_only_cas(extra_ca: str = "", bundle: str = SYSTEM_BUNDLE, packaged: str = PACKAGED_CAS) -> list[str]:
    """The subjects of the CAs the host's ``bundle`` trusts that a sandbox does not: neither in
    the distribution's set (``packaged``, which the built-in image has) nor in ``extra_ca``.
    Such a CA is usually a TLS-intercepting upstream's, and then every TLS download in a
    sandbox fails to verify until ``[network] extra_ca`` names it."""
    try:
        host = _certs(Path(bundle).read_bytes())
    except OSError:
        return []
    known: set[bytes] = set()
    for root, _dirs, files in os.walk(packaged):
        for f in files:
            if f.endswith(".crt"):
                try:
                    known.update(c.public_bytes(serialization.Encoding.DER) for c in _certs(Path(root, f).read_bytes()))
                except OSError:
                    continue
    if extra_ca:
        try:
            known.update(c.public_bytes(serialization.Encoding.DER) for c in _certs(Path(extra_ca).read_bytes()))
        except OSError:
            pass
    return [c.subject.rfc4514_string() for c in host if c.public_bytes(serialization.Encoding.DER) not in known]


def bundle_with_system(ca_pem: str) -> str:
    """The sandbox's trust bundle: the host's system CAs plus ``ca_pem`` (its proxy CA, extra CAs)."""
    for p in (SYSTEM_BUNDLE, "/etc/pki/tls/certs/ca-bundle.crt"):
        try:
            return Path(p).read_text() + "\n" + ca_pem
        except OSError:
            continue
    return ca_pem
