"""The cluster's certificate files (warmbox.cluster.tls), without a cluster: the CA is made once
with its key 0600, members are issued by it and checked against it, and nothing is read through
a symlink, from a file others can read (a key) or write, or from another CA."""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509

from warmbox.cluster import tls
from warmbox.errors import ClusterError


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_the_ca_is_made_once_and_members_are_issued_by_it(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    assert tls.ensure_ca(d) is True
    ca = (d / tls.CA_CERT).read_bytes()
    assert tls.ensure_ca(d) is False and (d / tls.CA_CERT).read_bytes() == ca  # kept, never remade
    assert _mode(d / tls.CA_KEY) == 0o600 and _mode(d) == 0o700
    m = tls.issue(d, tls.node_member("n1"), ("10.0.0.5",), ("n1.example",))
    assert _mode(m.key) == 0o600
    assert tls.member(d, "node-n1") == m
    assert {"node-n1", "localhost", "n1.example", "127.0.0.1", "::1", "10.0.0.5"} <= tls.names(m)
    cert = x509.load_pem_x509_certificate(m.cert.read_bytes())
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=tls.MEMBER_DAYS - 1) < left <= datetime.timedelta(days=tls.MEMBER_DAYS)
    tls.check_covers(m, "n1", ("10.0.0.5", "127.0.0.1"))
    with pytest.raises(ClusterError, match=r"warmbox cluster cert n1 --ip 10\.0\.0\.5 --ip 10\.0\.0\.6"):
        tls.check_covers(m, "n1", ("10.0.0.6",))
    assert tls.issue(d, tls.ROUTER).client_context().verify_mode.name == "CERT_REQUIRED"
    head = tls.head_member(d, ("10.0.0.9",))
    assert (
        "10.0.0.9" in tls.names(head) and tls.head_member(d, ("10.0.0.9",)).cert.read_bytes() == head.cert.read_bytes()
    )


def test_bad_names_and_addresses_are_typed_errors(tmp_path: Path) -> None:
    tls.ensure_ca(tmp_path)
    for bad in ("ca", "node-N1", "node-", "../x", "node-a/b"):
        with pytest.raises(ClusterError):
            tls.issue(tmp_path, bad)
    with pytest.raises(ClusterError, match="not an IP"):
        tls.issue(tmp_path, "node-n1", ("10.0.0.300",))
    with pytest.raises(ClusterError, match="warmbox cluster cert n2 --ip"):
        tls.member(tmp_path, "node-n2")  # none issued: says how to make it
    with pytest.raises(ClusterError, match="--router"):
        tls.member(tmp_path, tls.ROUTER)


def test_a_half_ca_is_never_completed(tmp_path: Path) -> None:
    tls.ensure_ca(tmp_path)
    (tmp_path / tls.CA_KEY).unlink()
    with pytest.raises(ClusterError, match="incomplete"):
        tls.ensure_ca(tmp_path)


def test_keys_and_certificates_are_not_read_through_symlinks_or_loose_modes(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    tls.ensure_ca(d)
    m = tls.issue(d, tls.node_member("n1"))
    # a symlinked key (to a file of someone else's choosing)
    planted = tmp_path / "planted.key"
    planted.write_bytes(m.key.read_bytes())
    planted.chmod(0o600)
    m.key.unlink()
    os.symlink(planted, m.key)
    with pytest.raises(ClusterError, match="symbolic"):
        tls.member(d, "node-n1")
    m.key.unlink()
    m.key.write_bytes(planted.read_bytes())
    m.key.chmod(0o644)  # readable by others
    with pytest.raises(ClusterError, match="readable by others"):
        tls.member(d, "node-n1")
    m.key.chmod(0o600)
    m.cert.chmod(0o666)  # anyone could replace it
    with pytest.raises(ClusterError, match="writable by others"):
        tls.member(d, "node-n1")
    m.cert.chmod(0o644)
    (d / tls.CA_KEY).chmod(0o640)
    with pytest.raises(ClusterError, match="readable by others"):
        tls.issue(d, tls.ROUTER)  # the CA key too


def test_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    tls.ensure_ca(ours)
    tls.ensure_ca(theirs)
    forged = tls.issue(theirs, tls.node_member("n1"))
    (ours / "node-n1.crt").write_bytes(forged.cert.read_bytes())
    (ours / "node-n1.key").write_bytes(forged.key.read_bytes())
    (ours / "node-n1.key").chmod(0o600)
    with pytest.raises(ClusterError, match="not signed by the cluster CA"):
        tls.member(ours, "node-n1")
    other_key = tls.issue(ours, tls.node_member("n2"))
    (ours / "node-n1.key").write_bytes(other_key.key.read_bytes())  # a key that is not the certificate's
    tls.issue(ours, tls.node_member("n1"))
    (ours / "node-n1.key").write_bytes(other_key.key.read_bytes())
    with pytest.raises(ClusterError, match="is not the key of"):
        tls.member(ours, "node-n1")
