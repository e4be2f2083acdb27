"""The one signing key (in the registry) and scheme of access tokens and signed file URLs
(warmbox.engine.signing): what E2B's SDKs compute from a token, the server accepts, and nothing else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from warmbox.engine import signing
from warmbox.errors import ConfigError, InvalidArgument, Unauthenticated
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(tmp: Path) -> Registry:
    return Registry(tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def test_one_key_per_registry_whoever_asks_first(tmp_path):
    a, b = _registry(tmp_path), _registry(tmp_path)  # a router's and a node's view of one registry
    key = signing.registry_key(a)
    assert len(key) == 32 and signing.registry_key(b) == key
    b.meta.add_meta_text(signing.KEY_NAME, "00" * 32)  # a second maker loses the race: the first key stays
    assert signing.registry_key(a) == key
    a.meta.set_meta_text(signing.KEY_NAME, "not hex")
    with pytest.raises(ConfigError, match="signing_key"):
        signing.registry_key(a)


def test_a_signature_names_one_sandbox_path_operation_user_signer_and_expiry():
    s = signing.Signer(b"k" * 32)
    at = int(time.time()) + 60
    sig = s.sign_file("~acme", "sb-000000000001", "/workspace/a", "read", "user", at)
    args = ("sb-000000000001", "/workspace/a", "read", "user", at)
    assert s.check_file(["key-x", "~acme"], *args, sig) == "~acme"
    for changed in (
        ("sb-000000000002", "/workspace/a", "read", "user", at),
        ("sb-000000000001", "/workspace/b", "read", "user", at),
        ("sb-000000000001", "/workspace/a", "write", "user", at),
        ("sb-000000000001", "/workspace/a", "read", "root", at),
        ("sb-000000000001", "/workspace/a", "read", "user", at + 1),
    ):
        with pytest.raises(Unauthenticated):
            s.check_file(["~acme"], *changed, sig)
    with pytest.raises(Unauthenticated):
        s.check_file(["~other"], *args, sig)
    with pytest.raises(Unauthenticated):
        signing.Signer(b"j" * 32).check_file(["~acme"], *args, sig)  # another registry's key
    with pytest.raises(Unauthenticated, match="expired"):
        signing.expiration(str(at - 120))
    with pytest.raises(InvalidArgument):
        signing.expiration("-5")


def test_tokens_are_bound_to_their_sandbox_and_match_e2bs_own_signer():
    s = signing.Signer(b"k" * 32)
    token = s.token("key-abc", "sb-000000000001")
    assert s.signer(token, "sb-000000000001") == "key-abc"
    for bad in (token + "x", token.replace("key-abc", "key-abd"), "e2b_" + token):
        with pytest.raises(Unauthenticated):
            s.signer(bad, "sb-000000000001")
    with pytest.raises(Unauthenticated):
        s.signer(token, "sb-000000000002")
    e2b_signature = pytest.importorskip("e2b.sandbox.signature", reason="the e2b extra")
    got = e2b_signature.get_signature("/home/user/a", "write", "user", token, 60)
    ours = signing.file_signature("/home/user/a", "write", "user", token, got["expiration"])
    assert got["signature"] == ours
