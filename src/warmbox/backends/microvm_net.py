"""A microVM's own network namespace: the tap its NIC uses, and where the egress link attaches.

Every sandbox VM has a virtio-net NIC (a memory image restores only into the devices it was
saved with, so the template has one, and so does every VM restored from it) backed by the tap
``wbtap`` in a network namespace of its own, in which QEMU itself runs (a QEMU that broke out
of its device models sees no host interface)::

    guest                       VM netns  wbv-<hash>                       egress netns
    eth0 169.254.77.2/30 ── tap ── wbtap 169.254.77.1/30    eth0 10.239.x.y ── veth ── wbs<slot>
    default via 169.254.77.1        forward wbtap -> eth0 only, masquerade
                                    (eth0 exists only while the sandbox has a network policy)

The guest's side is the same in every VM (set by the image's init at the template's boot, so a
restore needs no guest step): the host side makes it this sandbox's. Its packets leave with the
link's address (masquerade on eth0), which is what the egress rules and the proxy key on; a
fork is a new VM in a new namespace with its own link; what the link's routes reach (the
gateway; whatever the egress namespace refuses and logs) is the container tier's. Without a link
(network "none") the namespace has no route: the guest's connections are refused at once.
Fixed MACs on both sides keep the neighbour entries of a restored guest valid.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
from pathlib import Path

from warmbox.errors import SandboxStartError

TAP = "wbtap"
HOST_MAC = "02:77:62:00:00:01"
GUEST_MAC = "02:77:62:00:00:02"
HOST_ADDR = "169.254.77.1"
GUEST_ADDR = "169.254.77.2"
PREFIX = 30
CLONE_NEWNET = 0x40000000
LINK_IF = "eth0"  # the egress link's name in the namespace (network.netns.attach makes it)


def netns_name(state: Path) -> str:
    """The VM's namespace name (one per state dir: unique across warmbox homes on the host)."""
    return "wbv-" + hashlib.sha256(str(state).encode()).hexdigest()[:12]


def netns_path(state: Path) -> Path:
    return Path("/run/netns") / netns_name(state)


def _ruleset() -> str:
    return f"""
table ip wbvm {{
  chain prerouting {{
    type filter hook prerouting priority 0; policy accept;
    # no route (no link yet, or a destination besides the gateway): refused at once, as a
    # container without a link fails at once (a resolver then gives up instead of waiting)
    iifname "{TAP}" fib daddr oif missing meta l4proto tcp reject with tcp reset
    iifname "{TAP}" fib daddr oif missing reject with icmp type port-unreachable
  }}
  chain input {{
    type filter hook input priority 0; policy drop;
    iif "lo" accept
    ct state established,related accept
    meta l4proto tcp reject with tcp reset
    reject with icmp type admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
    # out by the link only: the egress namespace decides (and logs) what a destination gets
    iifname "{TAP}" oifname "{LINK_IF}" accept
    iifname "{LINK_IF}" oifname "{TAP}" ct state established,related accept
    iifname "{TAP}" meta l4proto tcp reject with tcp reset
    iifname "{TAP}" reject with icmp type admin-prohibited
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    oifname "{LINK_IF}" masquerade
  }}
}}
"""


def _batch() -> str:
    return (
        "link set lo up\n"
        f"tuntap add dev {TAP} mode tap\n"
        f"link set {TAP} address {HOST_MAC}\n"
        f"addr add {HOST_ADDR}/{PREFIX} dev {TAP}\n"
        f"link set {TAP} up\n"
    )


_SYSCTLS = (
    ("net/ipv6/conf/all/disable_ipv6", "1"),
    ("net/ipv6/conf/default/disable_ipv6", "1"),
    ("net/ipv4/ip_forward", "1"),
)


def _configure(path: Path) -> None:
    """Inside the namespace (a thread of its own: setns moves only the calling thread, and the
    thread ends with it): sysctls, the tap (one ``ip -batch``), the rules (one ``nft``)."""
    setns(str(path))
    for key, value in _SYSCTLS:
        with open(f"/proc/sys/{key}", "w") as f:  # the calling thread's namespace's
            f.write(value)
    _run(["ip", "-batch", "-"], "its tap", stdin=_batch())
    _run(["nft", "-f", "-"], "its rules", stdin=_ruleset())


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


def _run(argv: list[str], what: str, stdin: str | None = None) -> None:
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxStartError(f"the microVM's network namespace: {what}: {e}") from None
    if r.returncode != 0:
        raise SandboxStartError(f"the microVM's network namespace: {what}: {r.stderr.strip()[-300:]}")


def prepare(state: Path) -> Path:
    """A fresh namespace for the VM of ``state`` (blocking; a stale one of an earlier run of the
    same sandbox, e.g. before a pause, is replaced). Returns its path."""
    remove(state)
    name = netns_name(state)
    _run(["ip", "netns", "add", name], "creating it")
    try:
        failed: list[BaseException] = []

        def configure() -> None:
            try:
                _configure(netns_path(state))
            except BaseException as e:  # handed to the caller's thread
                failed.append(e)

        t = threading.Thread(target=configure, name="wb-vmnet")
        t.start()
        t.join()
        if failed:
            if isinstance(failed[0], OSError):
                raise SandboxStartError(f"the microVM's network namespace: {failed[0]}") from None
            raise failed[0]
    except BaseException:
        remove(state)
        raise
    return netns_path(state)


def remove(state: Path) -> None:
    """Delete the VM's namespace (its tap, rules and any egress link with it); idempotent."""
    if not netns_path(state).exists():
        return
    try:
        _run(["ip", "netns", "del", netns_name(state)], "deleting it")
    except SandboxStartError:
        if netns_path(state).exists():  # (gone: a concurrent destroy of the same sandbox deleted it)
            raise


def enter(state: Path) -> list[str]:
    """The argv prefix that runs a program in the VM's namespace."""
    return ["nsenter", f"--net={netns_path(state)}", "--"]


def qemu_args() -> list[str]:
    """QEMU's NIC: virtio-net on the namespace's tap, no offloads (no vnet header: the device's
    features must not depend on the host's tap), a fixed MAC (the guest's neighbour entries)."""
    return [
        "-netdev",
        f"tap,id=net0,ifname={TAP},script=no,downscript=no,vnet_hdr=off",
        "-device",
        f"virtio-net-device,netdev=net0,mac={GUEST_MAC}",
    ]
