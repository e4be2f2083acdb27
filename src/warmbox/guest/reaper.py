"""The agent as PID 1: the one owner of waitpid(), and the walk that signals a process tree."""

from __future__ import annotations

import _signal as signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import os
import threading


class Reaper:
    """Single owner of waitpid(): reaps every child and orphan, hands statuses to waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._statuses: dict[int, int] = {}
        self._wakeups: dict[int, int] = {}  # pid -> write end of a pipe poked on exit
        self._events: dict[int, threading.Event] = {}
        self._have_children = threading.Event()
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def register(self, pid: int, wakeup_fd: int | None = None) -> threading.Event:
        with self._lock:
            ev = self._events.setdefault(pid, threading.Event())
            if wakeup_fd is not None:
                self._wakeups[pid] = wakeup_fd
            if pid in self._statuses:
                ev.set()
                if wakeup_fd is not None:
                    os.write(wakeup_fd, b"x")
        self._have_children.set()
        return ev

    def status(self, pid: int) -> int | None:
        with self._lock:
            return self._statuses.get(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._statuses.pop(pid, None)
            self._events.pop(pid, None)
            self._wakeups.pop(pid, None)

    def _run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # No children: sleep until register() says one exists. Clearing *after* the
                # wait means a registration that raced the ECHILD is never missed.
                self._have_children.wait(1.0)
                self._have_children.clear()
                continue
            except InterruptedError:  # pragma: no cover
                continue
            with self._lock:
                self._statuses[pid] = status
                ev = self._events.get(pid)
                if ev is not None:
                    ev.set()
                fd = self._wakeups.get(pid)
                if fd is not None:
                    try:
                        os.write(fd, b"x")
                    except OSError:
                        pass
                if len(self._statuses) > 4096:  # orphans nobody waits for: bound the memory
                    for k in [k for k in self._statuses if k not in self._events][:2048]:
                        del self._statuses[k]


def _proc_table() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, pgrp, session) for every visible process."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        try:
            out.append((int(name), int(rest[1]), int(rest[2]), int(rest[3])))
        except (IndexError, ValueError):
            continue
    return out


def kill_tree(root: int, sig: int = signal.SIGKILL, rounds: int = 8) -> None:
    """Signal ``root``, its process group and session, and every descendant.

    For SIGKILL the tree is first frozen with SIGSTOP, round by round, so a process that
    setsid()s or double-forks cannot escape by being reparented before it is found.
    """
    me = os.getpid()
    targets: set[int] = set()
    for _ in range(rounds):
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, ppid, _, _ in table:
            children.setdefault(ppid, []).append(pid)
        found = {pid for pid, _, pgrp, sid in table if pgrp == root or sid == root}
        stack = [root, *targets]
        while stack:
            cur = stack.pop()
            if cur not in found:
                found.add(cur)
            stack.extend(c for c in children.get(cur, ()) if c not in found)
        found.discard(me)
        alive = {row[0] for row in table}
        new = (found & alive) - targets
        if not new:
            break
        targets |= new
        if sig != signal.SIGKILL:
            break
        for t in new:
            try:
                os.kill(t, signal.SIGSTOP)
            except OSError:
                pass
    try:
        os.killpg(root, sig)
    except OSError:
        pass
    for t in targets:
        try:
            os.kill(t, sig)
        except OSError:
            pass
