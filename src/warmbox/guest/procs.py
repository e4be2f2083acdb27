"""Background processes of the guest agent: bounded output rings drained by one thread.

Stdlib-only (runs inside the sandbox). A background process (``commands.run(background=True)``,
a PTY) outlives the request and the connection that started it. One pump thread drains every
such process's pipes or terminal into a ring of at most :data:`RING_BYTES` (less when many run:
:data:`TOTAL_BYTES` for all of them), dropping the oldest bytes when it is full, so a process
that nobody reads never blocks on its output and never grows the agent. Readers (Attach
requests) follow a ring by byte offset and are told how many bytes they missed.
"""

from __future__ import annotations

import collections
import os
import select
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RING_BYTES = 1 << 20  # most output kept per process
MIN_RING_BYTES = 64 << 10  # ... and at least this much, however many processes run
TOTAL_BYTES = 32 << 20  # the budget shared by all running background processes
MAX_RUNNING = 1024  # background processes tracked at once (limits.pids usually stops them first)
KEEP_FINISHED = 64  # ended processes kept for a late wait() (their exit status and ring)
EXIT_GRACE_S = 0.1  # output still drained after the process itself ended
_READ = 64 << 10

STDOUT, STDERR, PTY = 1, 2, 3


class Proc:
    """One background process: where its output went, and how it ended."""

    def __init__(
        self,
        pid: int,
        scope: Any,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        tag: str,
        outputs: dict[int, int],
        stdin: int | None,
        master: int | None,
    ) -> None:
        self.pid = pid
        self.scope = scope
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.tag = tag
        self.outputs = outputs  # fd -> STDOUT / STDERR / PTY
        self.stdin = stdin  # write end of its stdin pipe (the master, for a PTY); None once closed
        self.master = master
        self.started = time.monotonic()
        self.ended: float | None = None
        self.status: int | None = None  # wait status once ended
        self.chunks: collections.deque = collections.deque()  # (offset, kind, bytes)
        self.held = 0  # bytes in chunks
        self.base = 0  # offset of the first byte still held (= bytes dropped so far)
        self.total = 0  # bytes ever produced
        self.exited_at: float | None = None  # the process ended; its pipes may still drain
        self.stdin_lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self.ended is None

    def snapshot(self, offset: int) -> tuple[int, list[tuple[int, bytes]], int]:
        """(bytes lost before ``offset`` could be served, chunks from there as (kind, data), next
        offset). Call with the table's lock held."""
        lost = max(0, self.base - offset)
        start = max(offset, self.base)
        out = []
        for off, kind, data in self.chunks:
            end = off + len(data)
            if end <= start:
                continue
            out.append((kind, data[start - off :] if off < start else data))
        return lost, out, self.total


class ProcTable:
    """Every background process of the agent, and the one thread that drains their output."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified on output, an exit, a new process
        self.procs: dict[int, Proc] = {}
        self._by_fd: dict[int, Proc] = {}
        self._wake_by_fd: dict[int, Proc] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None

    # ---- registry

    def running(self) -> int:
        with self.lock:
            return sum(1 for p in self.procs.values() if p.running)

    def add(self, proc: Proc) -> None:
        with self.lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._pump, name="procs", daemon=True)
                self._thread.start()
            self.procs[proc.pid] = proc
            for fd in proc.outputs:
                os.set_blocking(fd, False)
                self._by_fd[fd] = proc
            self._wake_by_fd[proc.scope.wake_fd] = proc
            self._prune()
        self._poke()

    def get(self, pid: int) -> Proc | None:
        with self.lock:
            return self.procs.get(pid)

    def list(self) -> list[Proc]:
        with self.lock:
            return [p for p in self.procs.values() if p.running]

    def _prune(self) -> None:
        done = [p for p in self.procs.values() if not p.running]
        for p in sorted(done, key=lambda p: p.ended or 0)[: max(0, len(done) - KEEP_FINISHED)]:
            del self.procs[p.pid]

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already

    # ---- the pump

    def _cap(self) -> int:
        live = sum(1 for p in self.procs.values() if p.running) or 1
        return max(MIN_RING_BYTES, min(RING_BYTES, TOTAL_BYTES // live))

    def _append(self, proc: Proc, kind: int, data: bytes) -> None:
        proc.chunks.append((proc.total, kind, data))
        proc.total += len(data)
        proc.held += len(data)
        cap = self._cap()
        while proc.held > cap:
            off, k, old = proc.chunks[0]
            extra = proc.held - cap
            if len(old) <= extra:
                proc.chunks.popleft()
                proc.held -= len(old)
                proc.base = off + len(old)
            else:
                proc.chunks[0] = (off + extra, k, old[extra:])
                proc.held -= extra
                proc.base = off + extra

    def _pump(self) -> None:
        """The one drain of every background process; a bug in one round must not stop it (every
        process's output would stop being read, and none would ever be reported as ended)."""
        while True:
            try:
                self._drain()
            except Exception as e:  # pragma: no cover - a bug: say so, and start over
                print(f"warmbox agent: background output pump: {type(e).__name__}: {e}", file=sys.stderr)
                time.sleep(0.1)

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watched: set[int] = set()
        while True:
            with self.lock:
                want = set(self._by_fd) | set(self._wake_by_fd)
                grace = [p.exited_at for p in self.procs.values() if p.running and p.exited_at is not None]
            for fd in want - watched:
                poller.register(fd, select.POLLIN)
            for fd in watched - want:
                try:
                    poller.unregister(fd)
                except KeyError:
                    pass
            watched = want
            timeout = None
            if grace:
                timeout = max(0, int((min(grace) + EXIT_GRACE_S - time.monotonic()) * 1000) + 1)
            events = poller.poll(timeout)
            finished: list[Proc] = []
            with self.lock:
                for fd, _ in events:
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                        continue
                    proc = self._by_fd.get(fd)
                    if proc is not None:
                        try:
                            data = os.read(fd, _READ)
                        except BlockingIOError:
                            continue
                        except OSError:  # EIO: a terminal whose every user closed it
                            data = b""
                        if data:
                            self._append(proc, proc.outputs[fd], data)
                        else:
                            self._drop_fd(proc, fd)
                        continue
                    proc = self._wake_by_fd.pop(fd, None)
                    if proc is not None:
                        proc.scope.collect()
                        proc.exited_at = time.monotonic()
                now = time.monotonic()
                for proc in self.procs.values():
                    if proc.running and proc.exited_at is not None:
                        if not proc.outputs or now >= proc.exited_at + EXIT_GRACE_S:
                            finished.append(proc)
                self.changed.notify_all()
            for proc in finished:
                self._finish(proc)

    def _drop_fd(self, proc: Proc, fd: int) -> None:
        """Stop reading ``fd`` (lock held); the master of a PTY stays open for input until the end."""
        del self._by_fd[fd]
        del proc.outputs[fd]
        if fd != proc.master:
            os.close(fd)

    def _finish(self, proc: Proc) -> None:
        status = proc.scope.status()
        try:
            self.release_scope(proc.scope)
        except OSError:  # its cgroup or pipe is gone already: nothing left to release
            pass
        with self.lock:
            for fd in list(proc.outputs):
                self._drop_fd(proc, fd)
            proc.status = status
            proc.ended = time.monotonic()
            with proc.stdin_lock:  # a writer holds its own dup: closing these never hits a reused fd
                fds = [fd for fd in (proc.stdin, proc.master) if fd is not None]
                proc.stdin = proc.master = None
            for fd in set(fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._prune()
            self.changed.notify_all()

    release_scope: Any = None  # set by the agent: Scopes.finish


__all__ = ["PTY", "STDERR", "STDOUT", "Proc", "ProcTable"]
