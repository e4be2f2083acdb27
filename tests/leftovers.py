"""What a test run may not leave behind (issue 38): a process, cgroup, mount or network namespace of
a warmbox home the run made. Only those homes count (the session's own, and every home under the
run's pytest basetemp), and only what is provably theirs: a process naming the home or its runtime
dir, or living in one of their sandboxes' cgroups or their isolate hosts'; cgroups, namespaces
and mounts named after their sandboxes or runtime dirs. Other runs on the same host (other
homes, other sessions) are never looked at, and nothing here signals a process it did not find so.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
import time
from pathlib import Path

from warmbox.engine import guard

SETTLE_S = 30.0  # what ends on its own gets this long (a loaded 2-core host, idle daemons: 3-10 s)


class Home:
    """One home of the run and the names of everything it may have made on the host."""

    def __init__(self, path: Path) -> None:
        from warmbox.network.netns import egress_name, sandbox_netns_name
        from warmbox.paths import runtime_dir

        self.path = path
        self.runtime = runtime_dir(path)
        self.sandboxes = _sandbox_ids(path / "registry.db")
        tag = hashlib.sha256(str(self.runtime.resolve()).encode()).hexdigest()[:12]
        self.cgroups = {f"sb-{i}" if not i.startswith("sb-") else i for i in self.sandboxes}
        self.iso = f"iso-{tag}-"  # its isolate hosts' containers and cgroups (backends/isolate.py)
        self.netns = {sandbox_netns_name(i) for i in self.sandboxes} | {egress_name(self.runtime)}
        self.words = (str(path).encode(), str(self.runtime).encode())

    def owns_cgroup(self, name: str) -> bool:
        return name in self.cgroups or name.startswith(self.iso)


def _sandbox_ids(db: Path) -> set[str]:
    if not db.is_file():
        return set()
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return {r[0] for r in con.execute("SELECT sandbox_id FROM sandboxes")}
        finally:
            con.close()
    except sqlite3.Error:
        return set()


def homes_under(base: Path, depth: int = 3) -> list[Path]:
    """Every warmbox home (a directory with a registry.db) at most ``depth`` levels below ``base``."""
    found = []
    for level in range(1, depth + 1):
        found += [p.parent for p in base.glob("/".join(["*"] * level) + "/registry.db")]
    return found


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def scan(homes: list[Home]) -> list[str]:
    """What of ``homes`` is still on the host, one line each (empty: nothing)."""
    left: list[str] = []
    mine = _ancestors()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in mine:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            cgroup = (proc / "cgroup").read_text()
        except OSError:
            continue  # gone meanwhile
        names = {part for line in cgroup.splitlines() for part in line.rsplit(":", 1)[-1].split("/")}
        for h in homes:
            if any(w in cmd for w in h.words) or any(h.owns_cgroup(n) for n in names):
                argv = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
                left.append(f"process {proc.name} of {h.path}: {argv}")
                break
    base = Path("/sys/fs/cgroup")
    for d in [*base.glob("*/warmbox/*"), *base.glob("warmbox/*")]:
        for h in homes:
            if d.is_dir() and h.owns_cgroup(d.name):
                left.append(f"cgroup {d} of {h.path}")
    try:
        ns = set(os.listdir("/run/netns"))
    except OSError:
        ns = set()
    for h in homes:
        left += [f"network namespace {n} of {h.path}" for n in sorted(ns & h.netns)]
    try:
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        mounts = []
    for h in homes:
        roots = tuple(f"{w.decode()}/" for w in h.words)
        left += [f"mount {m} of {h.path}" for m in mounts if m.startswith(roots) or m.encode() in h.words]
    return left


def _stop_daemons(homes: list[Home]) -> None:
    """A home's daemon outlives its last user by ``[daemon] idle_exit`` by design: stopped here as
    ``warmbox down`` does (it destroys the pooled sandboxes), so what stays is what leaked."""
    from warmbox.engine import daemon

    for h in homes:
        if h.path.is_dir() and (guard.pid_of(h.path) or guard.guard_pid_of(h.path)):
            try:
                asyncio.run(daemon.down_home(h.path))
            except Exception:  # reported below by what it left, if anything
                pass


def check(paths: list[Path]) -> list[str]:
    """Stop the homes' daemons, give the rest SETTLE_S to end, and return what stayed (then end
    those processes by PID, so the host is left clean either way)."""
    homes = [Home(p) for p in dict.fromkeys(paths)]
    if not homes:
        return []
    _stop_daemons(homes)
    deadline = time.monotonic() + SETTLE_S
    while (left := scan(homes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for line in left:
        if line.startswith("process "):
            try:
                os.kill(int(line.split()[1]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    return left
