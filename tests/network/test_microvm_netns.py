"""A microVM's network namespace (backends/microvm_net.py) against a guest kernel that does anything:
the guest here is a namespace of the test's whose root claims a neighbour's address too and
routes everywhere, on a veth standing in for the VM's tap (same name, address and MAC on the host side).
Only the gateway answers, and only as the sandbox's own link address. No QEMU, no proxy: the
egress namespace's rules are warmbox's own (network.netns), a listener stands in for the proxy."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from warmbox.backends import microvm_net as vmnet
from warmbox.network import netns

pytestmark = pytest.mark.sandbox
SPOOFED = str(netns.SUBNET.network_address + 99)  # another sandbox's link address
CLIENT = """
import socket, sys
host, port, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    socket.create_connection((host, port), timeout=1, source_address=(source, 0) if source else None).close()
    print("connected")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("error", e.errno)
"""


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


def _connect(guest: str, host: str, port: int, source: str = "") -> str:
    r = subprocess.run(
        ["ip", "netns", "exec", guest, sys.executable, "-I", "-c", CLIENT, host, str(port), source],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return r.stdout.strip()


@pytest.fixture
def plumbing(tmp_path: Path):
    tag = secrets.token_hex(3)
    guest, egress = f"wbt-{tag}-guest", f"wbt-{tag}-eg"
    state = tmp_path / "vm"
    link = netns.link_for(f"sb-{tag}", 4000)
    vm_ns = vmnet.netns_name(state)
    import asyncio

    try:
        vmnet.prepare(state)
        _ip("netns", "add", guest)
        _ip("-n", vm_ns, "link", "del", vmnet.TAP)  # the tap's place: a veth to the test's "guest kernel"
        _ip("link", "add", vmnet.TAP, "netns", vm_ns, "type", "veth", "peer", "name", "eth0", "netns", guest)
        _ip("-n", vm_ns, "link", "set", vmnet.TAP, "address", vmnet.HOST_MAC)
        _ip("-n", vm_ns, "addr", "add", f"{vmnet.HOST_ADDR}/{vmnet.PREFIX}", "dev", vmnet.TAP)
        _ip("-n", vm_ns, "link", "set", vmnet.TAP, "up")
        _ip("-n", guest, "link", "set", "lo", "up")
        _ip("-n", guest, "addr", "add", f"{vmnet.GUEST_ADDR}/{vmnet.PREFIX}", "dev", "eth0")
        _ip("-n", guest, "addr", "add", f"{SPOOFED}/32", "dev", "eth0")
        _ip("-n", guest, "link", "set", "eth0", "up")
        _ip("-n", guest, "route", "add", "default", "via", vmnet.HOST_ADDR)
        asyncio.run(netns.ensure_egress(egress))
        yield guest, egress, link, state
    finally:
        vmnet.remove(state)
        for ns in (guest, egress):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert not vmnet.netns_path(state).exists()


def test_a_guest_kernel_reaches_only_the_gateway_as_its_link(plumbing):
    guest, egress, link, state = plumbing
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            egress,
            sys.executable,
            "-I",
            "-c",
            "import socket, sys\n"
            f"s = socket.create_server(('{netns.GATEWAY}', {netns.PROXY_PORT}))\n"
            "print('ready', flush=True)\ns.settimeout(20)\nc, a = s.accept()\nprint(a[0], flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        # no link yet (network "none"): refused at once, the gateway included
        for host, port in ((netns.GATEWAY, netns.PROXY_PORT), ("203.0.113.66", 80), (vmnet.HOST_ADDR, 22)):
            assert _connect(guest, host, port) == "refused", (host, port)
        assert _connect(guest, netns.GATEWAY, netns.PROXY_PORT, SPOOFED) != "connected"
        import asyncio

        asyncio.run(netns.attach(egress, link, str(vmnet.netns_path(state))))
        # linked: elsewhere is still refused (the VM's namespace routes only into the link, and the
        # egress namespace accepts nothing but its proxy and DNS ports)...
        for host, port in (("203.0.113.66", 80), ("192.0.2.1", 443), (vmnet.HOST_ADDR, 22), (netns.GATEWAY, 22)):
            assert _connect(guest, host, port) in ("refused", "error 113"), (host, port)
        # ...a neighbour's address gets no connection (it leaves as this link's; no answer finds it)...
        assert _connect(guest, netns.GATEWAY, netns.PROXY_PORT, SPOOFED) != "connected"
        # ...and the proxy port answers the guest as this sandbox's link address
        assert _connect(guest, netns.GATEWAY, netns.PROXY_PORT) == "connected"
        out, _ = server.communicate(timeout=20)
        assert out.strip() == link.address != SPOOFED
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
