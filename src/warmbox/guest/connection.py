"""One host connection: frames read on one thread, each request handed to a worker (or answered inline)."""

from __future__ import annotations

import _socket as socket
import collections
import threading

from warmbox import protocol as p
from warmbox.guest.base import Inbox, _Fail, _oserror
from warmbox.guest.dispatch import _HANDLERS, _INLINE, _PREPARED

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent, SerialPort
    from warmbox.guest.ports import _Tunnel


class Workers:
    """Threads that outlive one request: a thread start costs ~130 us, a hand-off ~25 us.

    A request never waits for a free worker (one is started when none is idle); at most
    ``keep`` idle workers stay, the rest end.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.tasks: collections.deque = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.idle = 0

    def submit(self, fn, arg) -> bool:
        """Run ``fn(arg)`` on a worker; False (nothing queued) if no thread could be started."""
        with self.cond:
            self.tasks.append((fn, arg))
            if self.idle > len(self.tasks) - 1:
                self.cond.notify()
                return True
        try:
            threading.Thread(target=self._run, daemon=True).start()
        except RuntimeError:  # e.g. the pids cgroup is full (threads count)
            with self.cond:
                try:
                    self.tasks.remove((fn, arg))
                except ValueError:
                    return True  # an idle worker took it meanwhile
            return False
        return True

    def spare(self) -> None:
        """Start a worker unless one is idle (call off any request's path): the next connection or
        request is then handed off, not kept waiting for a thread start."""
        with self.cond:
            if self.idle > len(self.tasks):
                return
        try:
            threading.Thread(target=self._run, daemon=True).start()
        except RuntimeError:  # the pids limit: the next submit tries again
            pass

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.tasks:
                    if self.idle >= self.keep:
                        return
                    self.idle += 1
                    self.cond.wait()
                    self.idle -= 1
                fn, arg = self.tasks.popleft()
            fn(arg)


class Connection:
    def __init__(self, agent: Agent, sock: socket.socket | SerialPort) -> None:
        self.agent = agent
        self.sock = sock
        self.reader = p.SocketReader(sock, p.HOST_TO_GUEST)  # one recv takes in every frame that arrived
        self._send_lock = threading.Lock()
        self._inboxes: dict[int, Inbox] = {}
        self._inbox_lock = threading.Lock()
        self.tunnels: dict[int, _Tunnel] = {}  # running PortConnects (under _inbox_lock)
        self.closed = False

    def send(self, msg: p.Message) -> None:
        data = p.encode(msg)
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def inbox(self, rid: int) -> Inbox:
        with self._inbox_lock:
            box = self._inboxes.get(rid)
            if box is None:
                box = self._inboxes[rid] = Inbox()
            return box

    def serve(self) -> None:
        try:
            while True:
                try:
                    msg = self.reader.recv()
                except p.ProtocolViolation as e:
                    self.send(p.Failure(id=0, code=p.ErrorCode.INVALID, message=str(e)))
                    break
                except OSError:
                    break
                if msg is None:
                    break
                if isinstance(msg, p.StdinData):
                    self.inbox(msg.id).put(msg)
                    continue
                if isinstance(msg, (p.Chunk, p.ChunkEnd)):  # for a running upload only: after its
                    with self._inbox_lock:  # failure the rest is dropped, not queued forever
                        box = self._inboxes.get(msg.id)
                    if box is not None:
                        box.put(msg)
                    continue
                if isinstance(msg, (p.ReadAck, p.Cancel)):  # for a running read only: late ones are dropped
                    with self._inbox_lock:
                        box = self._inboxes.get(msg.id)
                        tunnel = self.tunnels.get(msg.id) if isinstance(msg, p.Cancel) else None
                    if box is not None:
                        box.put(msg)
                    if tunnel is not None:  # now: its worker may be stuck writing to a server that never reads
                        tunnel.stop()
                    continue
                if isinstance(msg, _PREPARED):
                    self.inbox(msg.id)  # before its worker starts: a Cancel (or data) may come first
                if type(msg) in _INLINE:  # answered at once, no thread hand-off
                    self._handle(msg)
                    continue
                if not self.agent.workers.submit(self._handle, msg):
                    with self._inbox_lock:
                        self._inboxes.pop(msg.id, None)
                    self.send(
                        p.Failure(
                            id=msg.id,
                            code=p.ErrorCode.EXEC_FAILED,
                            message="the sandbox's process limit (limits.pids) is reached; "
                            "the agent could not start a thread for this request",
                        )
                    )
        finally:
            self.closed = True
            with self._inbox_lock:
                for q in self._inboxes.values():
                    q.put(None)
                tunnels = list(self.tunnels.values())
            for t in tunnels:
                t.stop()
            try:
                self.sock.close()
            except OSError:
                pass

    def _handle(self, msg: p.Message) -> None:
        try:
            handler = _HANDLERS[type(msg)]
            handler(self.agent, self, msg)
        except _Fail as e:
            self.send(p.Failure(id=msg.id, code=e.code, message=str(e)))
        except OSError as e:
            f = _oserror(e)
            self.send(p.Failure(id=msg.id, code=f.code, message=str(f)))
        except Exception as e:  # a bug in the agent must not kill the connection
            self.send(p.Failure(id=msg.id, code=p.ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"))
        finally:
            with self._inbox_lock:
                self._inboxes.pop(msg.id, None)
