"""The egress namespace: the only place a sandbox's packets can go.

Topology (one egress namespace per warmbox runtime dir, made on demand)::

    sandbox netns                 egress netns  wb-<hash>               proxy's own netns
    eth0 10.239.x.y/32  ── veth ── wbs<slot>    (no uplink, no forwarding)   (host, or a test's)
    route: 10.239.0.1 only        lo 10.239.0.1: proxy :3128, DNS :53 ──► upstream sockets

The sandbox's routes all lead to the gateway; IPv6 is disabled in it. The egress namespace has
no route anywhere, forwarding off, and an nftables table that accepts from a sandbox only TCP to
the proxy port and UDP to the DNS port, and only from the address assigned to that veth (no
spoofing a neighbour). Everything else (a raw IP, other ports, ICMP) is logged to NFLOG group
:data:`~warmbox.network.nflog.GROUP` (rate-limited per sandbox; the proxy audits it, see
:mod:`warmbox.network.nflog`) and refused at once. The proxy listens there but opens its
upstream connections from its own namespace.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import ipaddress
import os
from pathlib import Path

from warmbox.errors import NetworkError

CLONE_NEWNET = 0x40000000
SUBNET = ipaddress.ip_network("10.239.0.0/16")
GATEWAY = "10.239.0.1"
PROXY_PORT = 3128
DNS_PORT = 53
TABLE = "warmbox"
FIRST_HOST = 16


NetworkSetupError = NetworkError  # creating or configuring a namespace, link or rule failed


@dataclasses.dataclass(frozen=True)
class Link:
    """One sandbox's attachment: its address and the egress-side veth name."""

    sandbox_id: str
    address: str
    host_ifname: str


def egress_name(runtime: Path) -> str:
    import hashlib

    return "wb-" + hashlib.sha256(str(runtime).encode()).hexdigest()[:12]


def netns_path(name_or_path: str) -> str:
    return name_or_path if name_or_path.startswith("/") else f"/run/netns/{name_or_path}"


def link_for(sandbox_id: str, slot: int) -> Link:
    if not 0 <= slot < SUBNET.num_addresses - FIRST_HOST - 1:
        raise NetworkSetupError(f"no address left for slot {slot}")
    return Link(sandbox_id, str(SUBNET.network_address + FIRST_HOST + slot), f"wbs{slot}")


def setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


RUN_TIMEOUT_S = 60.0  # one ip/nft/nsenter command (rtnl waits on a loaded host take seconds, never this)


async def _run(argv: list[str], stdin: bytes | None = None) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(stdin), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise NetworkSetupError(f"{' '.join(argv[:4])}: no answer within {RUN_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        raise NetworkSetupError(f"{' '.join(argv[:4])}: {err.decode(errors='replace').strip()[:400]}")


LOG_RATE = "50/second burst 100 packets"  # refused packets logged per sandbox address (kernel-side)


def _refused_rules() -> str:
    from warmbox.network import nflog

    # ``refused`` runs before routing, so it sees packets to any address (forwarding is off: they
    # would be dropped unseen): the ones not for the proxy or resolver are logged (rate-limited
    # per sandbox address, headers only) for the audit, then refused at once (TCP reset, ICMP
    # admin-prohibited) so the sandbox's connect fails fast. Only packets whose source matches
    # their veth are logged (the address names the sandbox); any other is dropped.
    peer = "ip saddr . iifname @peers"
    return f"""
table inet {TABLE} {{
  set lograte {{ type ipv4_addr; size 65535; flags dynamic,timeout; timeout 60s; }}
  chain refused {{
    type filter hook prerouting priority -10; policy accept;
    iifname != "wbs*" accept
    {peer} ip daddr {GATEWAY} tcp dport {PROXY_PORT} accept
    {peer} ip daddr {GATEWAY} udp dport {DNS_PORT} accept
    {peer} ip daddr {GATEWAY} icmp type {{ destination-unreachable, time-exceeded, parameter-problem }} drop
    {peer} update @lograte {{ ip saddr limit rate {LOG_RATE} }} \\
      log prefix "{nflog.PREFIX}" group {nflog.GROUP} snaplen {nflog.SNAPLEN}
    {peer} meta l4proto tcp reject with tcp reset
    {peer} reject with icmpx admin-prohibited
    drop
  }}
}}
"""


def _ruleset() -> str:
    return f"""
table inet {TABLE} {{
  set peers {{ type ipv4_addr . ifname; }}
  chain input {{
    type filter hook input priority 0; policy drop;
    iif "lo" accept
    ip saddr . iifname @peers ip daddr {GATEWAY} tcp dport {PROXY_PORT} accept
    ip saddr . iifname @peers ip daddr {GATEWAY} udp dport {DNS_PORT} accept
    ip saddr . iifname @peers meta l4proto tcp reject with tcp reset
    ip saddr . iifname @peers reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
  }}
}}
""" + _refused_rules()


async def ensure_egress(name: str) -> None:
    """Create the egress namespace with its gateway address and rules (idempotent)."""
    path = netns_path(name)
    if Path(path).exists():
        # one made by an older warmbox (links may be live in it): add what it lacks
        probe = ["ip", "netns", "exec", name, "nft", "list", "chain", "inet", TABLE, "refused"]
        try:
            await _run(probe)
        except NetworkSetupError:
            await _run(["ip", "netns", "exec", name, "nft", "-f", "-"], stdin=_refused_rules().encode())
        return
    await _run(["ip", "netns", "add", name])
    try:
        await _run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "sh",
                "-ec",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6\n"
                "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6\n"
                "echo 0 > /proc/sys/net/ipv4/ip_forward\n"
                "ip link set lo up\n"
                f"ip addr add {GATEWAY}/32 dev lo\n"
                "nft -f -",
            ],
            stdin=_ruleset().encode(),
        )
    except BaseException:
        await remove_egress(name)
        raise


async def remove_egress(name: str) -> None:
    """Delete the egress namespace (and with it every veth end, route and rule in it)."""
    if Path(netns_path(name)).exists():
        await _run(["ip", "netns", "del", name])


async def attach(egress: str, link: Link, sandbox_netns: str) -> None:
    """Give the sandbox whose network namespace is ``sandbox_netns`` its veth into ``egress``."""
    await _run(
        [
            "nsenter",
            f"--net={sandbox_netns}",
            "--",
            "sh",
            "-ec",
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6\n"
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6\n"
            f"ip link add eth0 type veth peer name {link.host_ifname} netns {egress}\n"
            f"ip addr add {link.address}/32 dev eth0\n"
            "ip link set eth0 up\n"
            f"ip route add {GATEWAY}/32 dev eth0 scope link\n"
            # every other destination goes to the egress namespace too, where it is refused and
            # audited (without it a raw IP failed in the sandbox, unseen: ENETUNREACH)
            f"ip route add default via {GATEWAY} dev eth0\n",
        ]
    )
    try:
        await _run(
            [
                "ip",
                "netns",
                "exec",
                egress,
                "sh",
                "-ec",
                f"ip link set {link.host_ifname} up\n"
                f"ip route add {link.address}/32 dev {link.host_ifname} scope link src {GATEWAY}\n"
                f"nft add element inet {TABLE} peers '{{ {link.address} . \"{link.host_ifname}\" }}'\n",
            ]
        )
    except BaseException:
        await detach(egress, link)
        raise


def sandbox_netns_name(sandbox_id: str) -> str:
    """The named network namespace prepared for a sandbox whose tier takes its link before start."""
    return "wbn-" + sandbox_id


async def prepare(egress: str, link: Link, name: str) -> str:
    """A new named namespace ``name`` holding the sandbox's end of ``link`` (eth0, its address, the
    route to the gateway), for a runtime to start in; returns its path. The egress side is as
    :func:`attach` leaves it (the sandbox's packets are accepted from that moment)."""
    path = netns_path(name)
    await remove_sandbox_netns(name)  # a leftover of a start killed before its teardown
    await _run(["ip", "netns", "add", name])
    try:
        await _run(["ip", "-n", name, "link", "set", "lo", "up"])
        await attach(egress, link, path)
    except BaseException:
        await remove_sandbox_netns(name)
        raise
    return path


async def remove_sandbox_netns(name: str) -> None:
    """Delete a prepared namespace (its veth pair goes with it; idempotent)."""
    if Path(netns_path(name)).exists():
        await _run(["ip", "netns", "del", name])


async def detach(egress: str, link: Link) -> None:
    """Remove the sandbox's veth and rule element (no-op for parts already gone)."""
    if not Path(netns_path(egress)).exists():
        return
    await _run(
        [
            "ip",
            "netns",
            "exec",
            egress,
            "sh",
            "-c",
            f"nft delete element inet {TABLE} peers '{{ {link.address} . \"{link.host_ifname}\" }}' 2>/dev/null;"
            f"ip link del {link.host_ifname} 2>/dev/null; true",
        ]
    )


def links_in(egress: str) -> list[str]:
    """Names of the sandbox veths currently in the egress namespace (for tests and doctor)."""
    import subprocess

    if not Path(netns_path(egress)).exists():
        return []
    out = subprocess.run(["ip", "-n", egress, "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ": wbs" in line]
