"""Attack: flood the operator's approval queue by dialling many names (on_unknown="ask").

Every destination outside the allowlist of an ``ask`` sandbox becomes a question for a human
when no SDK callback answers it. A sandbox dialling thousands of random names must not bury the
queue (nor the host's memory, nor the audit log): a sandbox has at most ASK_OPEN_PER_SANDBOX
questions open, connections to one host:port share one, and the rest are denied at once with
rule "approval:queue-full" — itemised in the audit log up to a bound, then counted in one row.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from tests.network.conftest import a_net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox import operations as ops
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.network.proxy import ASK_OPEN_PER_SANDBOX, QUEUE_FULL_ROWS

pytestmark = pytest.mark.sandbox
FLOOD = 300

# Inside the sandbox: hold ASK_OPEN_PER_SANDBOX + 4 questions open (two connections on each
# host:port), then send FLOOD requests for random names through the proxy, one after another, and
# print how each ended (the proxy's status code, "-" if it closed without one).
SCRIPT = r"""
import os, socket, sys, time
from urllib.parse import urlsplit
proxy = urlsplit(os.environ["http_proxy"])
addr = (proxy.hostname, proxy.port)
token, hold, flood = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def send(name):
    s = socket.create_connection(addr, timeout=10)
    s.sendall(f"GET http://{name}/x HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
    return s

# an IPv6 zone id is free text: markup must never reach the operator's queue as a host name
s = socket.create_connection(addr, timeout=10)
s.sendall(b"CONNECT [2606:4700::1%<img/src=x/onerror=alert(1)>]:443 HTTP/1.1\r\n\r\n")
print(s.recv(64).split(b" ")[1].decode())
s.close()
held = [send(f"hold-{i}-{token}.attacker.example") for i in range(hold) for _ in range(2)]
time.sleep(1.0)  # the held ones are asked (or refused) before the flood starts
codes = {}
for i in range(flood):
    s = send(f"flood-{i}-{token}.attacker.example")
    try:
        head = s.recv(64).split(b" ")
        code = head[1].decode() if len(head) > 1 else "-"
    except OSError:
        code = "-"
    codes[code] = codes.get(code, 0) + 1
    s.close()
print(",".join(f"{k}:{v}" for k, v in sorted(codes.items())))
"""


@pytest.fixture
def ask_home(world, runc_ready):
    """A home of the fake internet whose questions stay open long enough to be counted (60 s)."""
    with a_net_home(world, f"wbt-q{world.tag}", 60) as path:
        yield path


def pending(home, sandbox_id: str) -> list:
    rows = asyncio.run(EngineFront(Engine.for_home(home)).handle(ops.ApprovalsList(pending_only=True)))
    return [a for a in rows if a.sandbox_id == sandbox_id and a.state == "pending"]


def test_a_flood_of_names_cannot_flood_the_approval_queue(ask_home, world):
    world.clear_logs()
    token = secrets.token_hex(4)
    hold = ASK_OPEN_PER_SANDBOX + 4
    sb = Sandbox.create(tier="container", network=Network(allow=[], on_unknown="ask"), timeout=120, home=ask_home)
    try:
        sb.files.write("/tmp/flood.py", SCRIPT)
        r = sb.commands.run(["python3", "/tmp/flood.py", token, str(hold), str(FLOOD)], timeout=60)
        assert r.exit_code == 0, r.stderr
        markup, flood = r.stdout.split()
        assert markup == "400"  # refused as a bad request, never asked about
        assert flood == f"403:{FLOOD}"  # every flooding request refused at once
        open_now = pending(ask_home, sb.sandbox_id)
        # one question per held host:port, at most ASK_OPEN_PER_SANDBOX of them; none for the flood
        subjects = sorted(a.subject for a in open_now)
        assert len(subjects) == ASK_OPEN_PER_SANDBOX == len(set(subjects))
        assert all(s.startswith("hold-") and s.endswith(f"-{token}.attacker.example:80") for s in subjects)

        full = [e for e in sb.network.log() if e.rule == "approval:queue-full"]
        assert all(e.decision == "deny" for e in full)
        itemised = [e for e in full if e.host != "*"]
        counted = [e for e in full if e.host == "*"]
        assert len(itemised) == QUEUE_FULL_ROWS and len(counted) == 1
        # the held names past the bound were refused too, and everything past the itemised rows counted
        past = (hold - ASK_OPEN_PER_SANDBOX) * 2 + FLOOD - QUEUE_FULL_ROWS
        assert counted[0].detail.startswith(f"{past} more connections denied unasked"), counted[0].detail
        assert "not asked" in itemised[0].detail and f"at most {ASK_OPEN_PER_SANDBOX}" in itemised[0].detail
    finally:
        sb.kill()
    # the sandbox is gone: so are its questions (nobody waits for an answer any more)
    assert pending(ask_home, sb.sandbox_id) == []
    asked = asyncio.run(EngineFront(Engine.for_home(ask_home)).handle(ops.ApprovalsList(limit=1000)))
    assert not [a for a in asked if "<" in a.subject or "%" in a.subject]
    assert not [q for q in world.log("dns") if token in q["name"]]  # no name went upstream
    assert world.log("attacker") == []
