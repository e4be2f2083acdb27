"""The egress proxy's supervisor, one per home: ``warmbox.network.proxy.main HOME`` (see :func:`launch_argv`).

It holds the home's lock and the listening sockets (proxy, DNS, control) and runs the proxy
itself as a child (``--serve``) that inherits them, so a proxy that dies (SIGKILL, OOM, a
crash) is replaced on the same sockets: connections and queries that arrive meanwhile wait
in the kernel's queues and are then decided by the new proxy (with the registry's current
policies); nothing is forwarded while none runs. The proxy reports each registration
(secrets, the sandbox's CA) over a socketpair; the supervisor keeps them in memory only and
replays them into the next proxy. Each death is audited for every linked sandbox; after
RESTART_BACKOFF_S is exhausted within RESTART_WINDOW_S it gives up (audited as proxy-down)
and exits, leaving the egress namespace (the sandboxes' links) for whoever starts it again.
The proxy dies with its supervisor (PR_SET_PDEATHSIG), so no unsupervised proxy remains.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from warmbox import config
from warmbox.models import NetEvent
from warmbox.storage.registry import open_registry


def control_path(home: Path) -> Path:
    """The proxy's control socket: the engine registers and forgets sandboxes there."""
    return home / "netproxy.sock"


RESTART_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def launch_argv() -> list[str]:
    """The command line of :func:`warmbox.network.proxy.main` (not ``-m``: importing warmbox imports
    that module already, and runpy would warn about running a second copy of it)."""
    return [sys.executable, "-c", "import sys; from warmbox.network.proxy import main; sys.exit(main(sys.argv[1:]))"]


def supervisor_pid_path(home: Path) -> Path:
    return home / "netproxy.supervisor.pid"


class Supervisor:
    """Runs the proxy as its child on the sockets it holds, replays the registrations into each new
    one, and audits each death for the linked sandboxes (see the module's docstring)."""

    def __init__(self, home: Path, socks: list[socket.socket]) -> None:
        self.home = home
        self.socks = socks
        self.registry = open_registry(home, config.load(home))
        self.state: dict[str, dict] = {}  # sandbox -> its last registration (memory only)
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def log(self, text: str) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} warmbox proxy supervisor: {text}", file=sys.stderr, flush=True)

    def audit_outage(self, rule: str, detail: str) -> None:
        """One ``proxy`` event (decision deny: nothing was served) for every linked sandbox."""
        try:
            for info, _ in self.registry.sandboxes.list(include_pooled=True):
                if self.registry.egress.link(info.sandbox_id) is not None:
                    self.registry.egress.add_net_event(
                        NetEvent(info.sandbox_id, time.time(), "proxy", "*", "", 0, "deny", rule, 0, 0, detail)
                    )
        except Exception as e:  # the supervisor outlives a registry hiccup
            self.log(f"cannot audit {rule}: {e}")

    def run(self) -> int:
        """Run the proxy until it stops cleanly (0), or until it keeps dying (1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        deaths: list[float] = []
        failed_starts = 0  # of those deaths, the ones in the current streak of starts that never served
        while not self.stopping:
            pid, rc, served_s = self.run_child()
            if rc == 0 or self.stopping:
                return 0
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            note = (
                f"the egress proxy (pid {pid}) {how} after serving {served_s:.1f} s"
                if served_s is not None
                else f"the egress proxy (pid {pid}) {how} before it served"
            )
            now = time.monotonic()
            if served_s is not None and failed_starts:
                # this proxy served: the streak of failed starts before it (a bad config, since
                # fixed) ended then, and must not count against this unrelated death
                deaths, failed_starts = deaths[:-failed_starts], 0
            elif served_s is None:
                failed_starts += 1
            deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            if len(deaths) > len(RESTART_BACKOFF_S):
                self.log(f"{note}; giving up after {len(deaths)} deaths within {RESTART_WINDOW_S:.0f} s")
                self.audit_outage(
                    "proxy-down",
                    f"{note}; not restarted again ({len(deaths)} deaths within "
                    f"{RESTART_WINDOW_S:.0f} s): egress is down until it is started "
                    f"again (see netproxy.log)",
                )
                return 1
            self.log(f"{note}; restarting it")
            if served_s is not None:  # a start that failed is not a new outage, just a longer one
                self.audit_outage(
                    "proxy-restart",
                    f"{note}; restarting it (connections open then were cut, their byte counts end there)",
                )
            self._sleep(RESTART_BACKOFF_S[len(deaths) - 1])
        return 0

    def _sleep(self, seconds: float) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.wake_r, selectors.EVENT_READ)
        sel.select(seconds)
        sel.close()

    def run_child(self) -> tuple[int, int, float | None]:
        """Start the proxy, feed it the kept registrations, serve its reports until it exits.

        (pid, exit status as Popen reports it, seconds it served or None if it never did).
        """
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [x.fileno() for x in self.socks] + [theirs.fileno()]
        proc = subprocess.Popen(
            [*launch_argv(), "--serve", str(self.home), str(os.getpid()), ",".join(map(str, fds))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=fds,
        )
        theirs.close()
        pidfd = os.pidfd_open(proc.pid)
        ready_at: float | None = None
        try:
            mine.settimeout(10)
            try:
                mine.sendall((json.dumps({"restore": list(self.state.values())}) + "\n").encode())
            except OSError:
                pass  # it died already: reaped below
            mine.setblocking(False)
            sel = selectors.DefaultSelector()
            sel.register(pidfd, selectors.EVENT_READ, "exit")
            sel.register(mine, selectors.EVENT_READ, "report")
            sel.register(self.wake_r, selectors.EVENT_READ, "signal")
            buf = b""
            kill_at = None
            while True:
                if self.stopping and kill_at is None:
                    proc.send_signal(signal.SIGTERM)  # it stops cleanly (exit 0)
                    kill_at = time.monotonic() + STOP_GRACE_S
                if kill_at is not None and time.monotonic() > kill_at:
                    proc.kill()
                events = sel.select(1.0)
                done = False
                for key, _ in events:
                    if key.data == "signal":
                        try:
                            os.read(self.wake_r, 64)
                        except OSError:
                            pass
                    elif key.data == "report":
                        buf, ready = self._reports(mine, buf, sel)
                        if ready and ready_at is None:
                            ready_at = time.monotonic()
                            write_pid(self.home / "netproxy.pid", proc.pid)
                    else:
                        done = True
                if done:
                    break
            rc = proc.wait()
            mine.setblocking(True)
            mine.settimeout(0.5)
            try:  # what it reported just before it died
                while True:
                    data = mine.recv(1 << 16)
                    if not data:
                        break
                    buf += data
            except OSError:
                pass
            self._apply(buf)
            sel.close()
        finally:
            os.close(pidfd)
            mine.close()
            (self.home / "netproxy.pid").unlink(missing_ok=True)
        return proc.pid, rc, (time.monotonic() - ready_at) if ready_at is not None else None

    def _reports(self, sock: socket.socket, buf: bytes, sel: selectors.BaseSelector) -> tuple[bytes, bool]:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return buf, False
        except OSError:
            data = b""
        if not data:
            sel.unregister(sock)
            return buf, False
        buf += data
        head, _, rest = buf.rpartition(b"\n")
        return rest, self._apply(head + b"\n" if head else b"")

    def _apply(self, lines: bytes) -> bool:
        ready = False
        for line in lines.splitlines():
            try:
                msg = json.loads(line)
                op, sid = msg.get("op"), str(msg.get("sandbox_id", ""))
            except (ValueError, AttributeError):
                continue
            if op == "register":
                self.state[sid] = {"sandbox_id": sid, "secrets": msg.get("secrets", []), "ca": msg.get("ca")}
            elif op == "forget":
                self.state.pop(sid, None)
            elif op == "ready":
                ready = True
        return ready


def write_pid(path: Path, pid: int) -> None:
    """``pid`` into the file ``path``, replaced whole (a reader never sees half a number)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(pid))
    tmp.replace(path)


def read_pid(path: Path) -> int | None:
    """The pid in the file ``path``; None if it is missing or unreadable."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None
