"""Someone on the node network attacks the cluster's Ray (issue 20).

Ray listens on every address (its GCS on the head, a raylet on every node) and, without token
authentication, runs whatever a driver submits: measured on this host, a process that knew only
the head's HOST:PORT ran ``os.getuid()`` -> 0 in a task in 0.05 s (``num_cpus=0`` on the nodes
does not stop a task asking for no CPU). warmbox now starts every Ray process with Ray's token
authentication and the cluster's token file, and refuses to start one without it.

The attacker here is a separate process with its own Ray temp dir and nothing of the cluster but
the address (and, for the control, the token): only this host's addresses are dialled.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox.cluster import membership, tls
from warmbox.errors import ClusterError
from warmbox.server import peer

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
ATTACK_S = 60  # the attacker's whole run, wall clock

ATTACKER = textwrap.dedent(
    """
    import os, sys
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    def pwn(path):
        open(path, "w").write(str(os.getuid()))
        return os.getuid()

    print("uid", ray.get(pwn.remote(sys.argv[2]), timeout=40), flush=True)
    """
)


@pytest.fixture(scope="module")
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="wbra-", dir="/tmp") as d:  # short: Ray's sockets
        yield Path(d)


@pytest.fixture(scope="module")
def token(tmp: Path) -> Path:
    path = tmp / "cluster.token"
    peer.ensure_token(path)
    return path


@pytest.fixture(scope="module")
def head(tmp: Path, token: Path) -> Iterator[membership.RayProcess]:
    h = membership.start_head(tmp / "h", token_file=token, tls=tls.head_member(tmp, tls.local_ips()))
    try:
        yield h
    finally:
        h.stop()
        assert membership.processes_in(tmp / "h") == []


def _router(tmp: Path) -> tls.Member:
    """A member's certificate of this cluster (the router's): Ray's TLS takes no client without one."""
    return tls.issue(tmp, tls.ROUTER)


def _attack(
    head: membership.RayProcess, tmp: Path, auth: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    mark = tmp / f"pwned-{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WARMBOX_"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp / f"a{secrets.token_hex(2)}"), HOME=str(tmp), **auth)
    r = subprocess.run(
        [sys.executable, "-c", ATTACKER, head.address, str(mark)],
        capture_output=True,
        text=True,
        env=env,
        timeout=ATTACK_S,
        cwd=tmp,
    )
    return r, mark


def test_a_driver_without_the_token_cannot_run_code_on_the_cluster(head, tmp, token):
    # Ray's default client, with a member's certificate (Ray's TLS) but no token (~20 s of retries)
    r, mark = _attack(head, tmp, _router(tmp).ray_env())
    assert r.returncode != 0 and "uid" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert not mark.exists()
    # control: the same driver with the cluster's token and a member's certificate does run its task
    # (so the refusal above is Ray's authentication, not a broken attacker)
    r, mark = _attack(head, tmp, {**membership.auth_env(token), **_router(tmp).ray_env()})
    assert r.returncode == 0 and "uid 0" in r.stdout, r.stderr[-2000:]
    assert mark.read_text() == "0"


PROBE = textwrap.dedent(
    """
    import sys
    from ray._raylet import GcsClient
    c = GcsClient(address=sys.argv[1])
    print("nodes", len(c.get_all_node_info(timeout=10)), flush=True)
    c.internal_kv_put(b"wb-redteam", b"x", True, None, timeout=5)
    print("written", flush=True)
    """
)


def test_a_gcs_client_without_the_token_cannot_read_or_change_the_cluster(head, tmp, token):
    wrong = tmp / "wrong.token"
    peer.ensure_token(wrong)
    for auth in (
        {},
        {"RAY_AUTH_MODE": "disabled"},
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_urlsafe(32)},  # a guess
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)},  # another cluster's token
        {**membership.auth_env(token), **_router(tmp).ray_env()},  # the control: last
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WARMBOX_"))}
        env.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp), **_router(tmp).ray_env())  # only the token differs
        env.update(auth)
        r = subprocess.run(
            [sys.executable, "-c", PROBE, head.address], capture_output=True, text=True, env=env, timeout=ATTACK_S
        )
        if auth.get("RAY_AUTH_TOKEN_PATH") == str(token.absolute()):
            assert r.returncode == 0 and r.stdout.split() == ["nodes", "1", "written"], r.stderr[-2000:]
        else:
            assert r.returncode != 0 and "nodes" not in r.stdout, (auth, r.stdout)
            assert "AuthenticationError" in r.stderr, r.stderr[-2000:]
    assert [n for n in membership.Membership(head.address, token, _router(tmp)).alive() if n.is_head]


def test_a_gcs_client_with_the_token_but_no_cluster_certificate_is_refused(head, tmp, token):
    """Ray's gRPC is TLS with the cluster's CA (issue 39): a client holding the token (a leaked
    token file) but speaking plaintext, or TLS with a certificate of another CA, gets nothing (each
    client waits out Ray's connect timeout, ~36 s here: the two run at once)."""
    other = tmp / "other-ca"
    tls.ensure_ca(other)
    forged = tls.issue(other, tls.ROUTER)
    tries = {
        "plaintext": {},
        "another CA": {**forged.ray_env(), "RAY_TLS_CA_CERT": str(tmp / tls.CA_CERT)},  # trusts the head, not trusted
        "control": _router(tmp).ray_env(),
    }
    procs = {}
    for what, extra in tries.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WARMBOX_"))}
        env.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp), **membership.auth_env(token), **extra)
        procs[what] = subprocess.Popen(
            [sys.executable, "-c", PROBE, head.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    for what, proc in procs.items():
        out, err = proc.communicate(timeout=ATTACK_S + 30)
        if what == "control":
            assert proc.returncode == 0 and out.split() == ["nodes", "1", "written"], err[-2000:]
        else:
            assert proc.returncode != 0 and "nodes" not in out, (what, out, err[-1000:])


def test_ray_is_never_started_without_a_valid_token(tmp):
    loose = tmp / "loose.token"
    loose.write_text(secrets.token_urlsafe(32))
    loose.chmod(0o644)
    planted = tmp / "planted.token"
    planted.write_text(secrets.token_urlsafe(32))
    planted.chmod(0o600)
    os.chown(planted, 65534, 65534)  # nobody's: whoever planted it knows it
    member = tls.head_member(tmp)
    for bad in ("", tmp / "missing.token", loose, planted):
        with pytest.raises(ClusterError):
            membership.start_head(tmp / "never", token_file=bad, tls=member)
    assert not (tmp / "never").exists() and membership.processes_in(tmp / "never") == []
