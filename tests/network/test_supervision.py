"""The proxy supervisor's bookkeeping, without sandboxes (its kill tests: tests/attacks/test_egress_proxy_death.py)."""

from __future__ import annotations

import json
import ssl

from warmbox.network.proxy import _ca_pems, _restore_ca
from warmbox.network.supervisor import Supervisor
from warmbox.network.tls import SandboxCA


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, name: str) -> None:
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for key, obj in (("c", c), ("s", s)):
            if not done[key]:
                try:
                    obj.do_handshake()
                    done[key] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


def test_a_restored_ca_is_the_one_the_sandbox_trusts(tmp_path):
    ca = SandboxCA("sb-x", tmp_path / "a")
    kept = json.loads(json.dumps(_ca_pems(ca)))  # as it travels to the supervisor and back
    again = _restore_ca(tmp_path / "b", *kept)
    assert again.cert_pem == ca.cert_pem
    client = ssl.create_default_context(cadata=ca.cert_pem)  # the sandbox's bundle holds the original
    _handshake(client, again.server_context("api.test"), "api.test")
    other = SandboxCA("sb-y", tmp_path / "c")
    try:
        _handshake(client, other.server_context("api.test"), "api.test")
        raise AssertionError("a fresh CA must not be trusted")
    except ssl.SSLCertVerificationError:
        pass
    for x in (ca, again, other):
        x.close()


def test_supervisor_keeps_registrations_until_forgotten(tmp_path):
    sup = Supervisor(tmp_path, [])
    reg = {
        "op": "register",
        "sandbox_id": "sb-1",
        "secrets": [{"placeholder": "p", "value": "v", "hosts": ["a.test"]}],
        "ca": ["k", "c"],
    }
    lines = [
        json.dumps(reg),
        json.dumps({"op": "register", "sandbox_id": "sb-2", "secrets": [], "ca": None}),
        "not json",
        json.dumps({"op": "forget", "sandbox_id": "sb-2"}),
        json.dumps({"op": "ready"}),
    ]
    assert sup._apply("\n".join(lines).encode()) is True
    assert list(sup.state) == ["sb-1"] and sup.state["sb-1"]["secrets"][0]["value"] == "v"
    assert sup._apply(b'{"op": "forget", "sandbox_id": "sb-1"}\n{"op": "regis') is False  # a cut line is dropped
    assert sup.state == {}
