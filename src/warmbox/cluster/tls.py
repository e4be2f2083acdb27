"""The cluster's certificates: one CA, and a certificate per member (the head, each node, the router).

Every hop between members is mutual TLS against this CA: the router's calls to a node's API (the
node asks for the router's certificate, the router checks the node's), and Ray's own gRPC (head,
raylets, the router's GCS client: ``RAY_USE_TLS`` with the member's certificate as both its server
and client certificate, the CA as the only root).

The files live in one directory (``[cluster] tls_dir``; default: the token file's):

    ca.crt                 the CA's certificate: every member has it
    ca.key                 the CA's key (0600): on the head's host (or the operator's) only
    head.crt / head.key    the head's own, issued by ``warmbox cluster head`` at each start
    node-NAME.crt / .key   a node's: ``warmbox cluster cert node-NAME --ip IP`` where the CA key is,
                           then copied to that node (its key never needs to leave the two)
    router.crt / .key      the router's: ``warmbox cluster cert router``

Keys are written 0600 (a temporary file, then renamed into place) and read through ``O_NOFOLLOW``
with ``fstat`` checks: a regular file of this process's user, readable by no one else, bounded in
size. A certificate is valid for ``MEMBER_DAYS``; its names are the member's (``node-n1``),
``localhost`` and the IP addresses given (a node's API address: the router checks it).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
import secrets
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from warmbox import paths
from warmbox.errors import ClusterError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
HEAD, ROUTER, NODE_PREFIX = "head", "router", "node-"
CA_DAYS = 3650
MEMBER_DAYS = 365
RENEW_DAYS = 30  # the head renews its own certificate this long before it expires
MAX_PEM = 64 << 10
MEMBER_NAME = re.compile(r"^(head|router|node-[a-z0-9][a-z0-9-]{0,62})$")


@dataclasses.dataclass(frozen=True)
class Member:
    """A member's TLS files (PEM): the cluster's CA certificate, its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        """TLS to another member: the CA as the only root (the peer's name or IP is checked), this
        member's certificate presented."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as e:
            raise ClusterError(f"cannot load the cluster certificate {self.cert}: {e}") from None
        return ctx

    def ray_env(self) -> dict[str, str]:
        """Ray's TLS on every gRPC channel of the process that gets this environment."""
        return {
            "RAY_USE_TLS": "1",
            "RAY_TLS_SERVER_CERT": str(self.cert),
            "RAY_TLS_SERVER_KEY": str(self.key),
            "RAY_TLS_CA_CERT": str(self.ca),
        }


def directory(tls_dir: str, token_file: str) -> Path:
    """Where the cluster's certificates are: ``tls_dir``, else the token file's directory."""
    if tls_dir:
        return Path(tls_dir).absolute()
    if not token_file:
        raise ClusterError("the cluster's certificates live in [cluster] tls_dir or beside [cluster] token_file")
    return Path(token_file).absolute().parent


def node_member(name: str) -> str:
    return NODE_PREFIX + name


def _check_name(member: str) -> str:
    if not MEMBER_NAME.match(member):
        raise ClusterError(f"a cluster member is 'head', 'router' or 'node-NAME' (a node's name), got {member!r}")
    return member


def _read(path: Path, private: bool) -> bytes:
    """A PEM file (:func:`warmbox.paths.read_member_file`), at most MAX_PEM bytes."""
    return paths.read_member_file(path, str(path), MAX_PEM, private=private)


def _write(path: Path, data: bytes, mode: int) -> None:
    """``data`` into ``path`` whole: a new temporary file beside it (O_EXCL, O_NOFOLLOW), then
    renamed over it (a symlink at ``path`` is replaced, never followed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        raise ClusterError(f"cannot write {path}: {e.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def ensure_ca(tls_dir: Path) -> bool:
    """The cluster's CA in ``tls_dir``, made if it has none (True: made now). Both files or
    neither: one alone is a ClusterError (a half-made or half-copied CA is never completed)."""
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert, key = tls_dir / CA_CERT, tls_dir / CA_KEY
    have = [p.exists() or p.is_symlink() for p in (cert, key)]
    if all(have):
        _load_ca(tls_dir)
        return False
    if any(have):
        missing = key if have[0] else cert
        raise ClusterError(f"the cluster CA in {tls_dir} is incomplete: {missing.name} is missing")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"warmbox cluster CA {secrets.token_hex(4)}")])
    now = _now()
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(key, _key_pem(ca_key), 0o600)  # the key first: a ca.crt never exists without its key
    _write(cert, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def _load_ca(tls_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(_read(tls_dir / CA_CERT, private=False))
        key = serialization.load_pem_private_key(_read(tls_dir / CA_KEY, private=True), None)
    except ValueError as e:
        raise ClusterError(f"the cluster CA in {tls_dir} cannot be read: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ClusterError(f"{tls_dir / CA_KEY} is not the key of {tls_dir / CA_CERT}")
    return cert, key


def issue(tls_dir: Path, member: str, ips: tuple[str, ...] = (), dns: tuple[str, ...] = ()) -> Member:
    """A certificate for ``member`` signed by the CA in ``tls_dir`` (its key must be here), written
    to ``tls_dir``/MEMBER.crt and .key (0600), replacing any before (a renewal). Its names: the
    member's, ``localhost``, 127.0.0.1 and ::1, ``dns`` and ``ips`` (the addresses others dial)."""
    _check_name(member)
    ca, ca_key = _load_ca(tls_dir)
    addresses = []
    for ip in ("127.0.0.1", "::1", *ips):
        try:
            addresses.append(ipaddress.ip_address(ip))
        except ValueError:
            raise ClusterError(f"not an IP address: {ip!r}") from None
    names = [member, "localhost", *dns]
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, member)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=MEMBER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.DNSName(n) for n in dict.fromkeys(names)),
                    *(x509.IPAddress(a) for a in dict.fromkeys(addresses)),
                ]
            ),
            critical=False,
        )
        # a member is a server to some and a client of others (Ray uses one certificate for both)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = Member(tls_dir / CA_CERT, tls_dir / f"{member}.crt", tls_dir / f"{member}.key")
    _write(out.key, _key_pem(key), 0o600)
    _write(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def member(tls_dir: Path, name: str) -> Member:
    """``name``'s files in ``tls_dir``, checked (ClusterError saying how to make them): the CA's
    certificate, the member's certificate signed by it and still valid, and its key."""
    _check_name(name)
    m = Member(tls_dir / CA_CERT, tls_dir / f"{name}.crt", tls_dir / f"{name}.key")
    how = "--router" if name == ROUTER else f"{name.removeprefix(NODE_PREFIX)} --ip ADDRESS"
    hint = f"make it where the CA key is with `warmbox cluster cert {how}` and copy it to {tls_dir}"
    if not m.cert.exists():
        raise ClusterError(f"this member has no cluster certificate {m.cert}: {hint}")
    try:
        ca = x509.load_pem_x509_certificate(_read(m.ca, private=False))
        cert = x509.load_pem_x509_certificate(_read(m.cert, private=False))
        key = serialization.load_pem_private_key(_read(m.key, private=True), None)
    except ValueError as e:
        raise ClusterError(f"the cluster certificate {m.cert} or its key cannot be read: {e}") from None
    if key.public_key() != cert.public_key():
        raise ClusterError(f"{m.key} is not the key of {m.cert}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ClusterError(f"{m.cert} is not signed by the cluster CA {m.ca}: {hint}") from None
    if cert.not_valid_after_utc <= _now():
        raise ClusterError(f"{m.cert} expired on {cert.not_valid_after_utc:%Y-%m-%d}: {hint}")
    return m


def names(m: Member) -> frozenset[str]:
    """The DNS names and IP addresses ``m``'s certificate is valid for."""
    cert = x509.load_pem_x509_certificate(_read(m.cert, private=False))
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(
        [*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))]
    )


def check_covers(m: Member, member_name: str, addresses: tuple[str, ...]) -> None:
    """ClusterError unless ``m``'s certificate names every one of ``addresses`` (hosts others dial:
    the router checks a node API's, Ray's GCS a raylet's), saying how to reissue it."""
    have = names(m)
    missing = [a for a in dict.fromkeys(addresses) if a and a not in have]
    if missing:
        flags = " ".join(f"--ip {a}" for a in sorted(set(missing) | {a for a in have if _is_ip(a)} - _LOOPBACK))
        raise ClusterError(
            f"the cluster certificate {m.cert} does not name {', '.join(missing)}, where other members reach "
            f"this one (its peers check it): reissue it with `warmbox cluster cert {member_name} {flags}`"
        )


_LOOPBACK = frozenset({"127.0.0.1", "::1"})


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def head_member(tls_dir: Path, ips: tuple[str, ...] = ()) -> Member:
    """The head's files: the CA made if there is none, the head's certificate issued when it has
    none or it expires within RENEW_DAYS (the head holds the CA key)."""
    ensure_ca(tls_dir)
    try:
        m = member(tls_dir, HEAD)
        cert = x509.load_pem_x509_certificate(_read(m.cert, private=False))
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        have = {str(a) for a in san.get_values_for_type(x509.IPAddress)}
        if cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_DAYS) and set(ips) <= have:
            return m
    except ClusterError:
        pass
    return issue(tls_dir, HEAD, ips)


def local_ips() -> tuple[str, ...]:
    """This host's IPv4 addresses (Ray advertises one of them as a node's address)."""
    out = []
    try:
        text = Path("/proc/net/fib_trie").read_text()
    except OSError:
        return ()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "/32 host LOCAL" in line and i > 0:
            ip = lines[i - 1].split()[-1]
            if ip not in out:
                out.append(ip)
    return tuple(out)


__all__ = [
    "CA_CERT",
    "CA_KEY",
    "HEAD",
    "ROUTER",
    "Member",
    "directory",
    "ensure_ca",
    "head_member",
    "issue",
    "local_ips",
    "member",
    "names",
    "check_covers",
    "node_member",
]
