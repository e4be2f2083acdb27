"""Host side of a microVM's agent port: many host clients over the VM's one serial stream.

A virtio-serial port is a single byte stream and QEMU serves one connection on it at a time,
while any number of warmbox processes may talk to one sandbox at once (an SDK object, the
CLI, the pool daemon). This relay — one small process per VM, started with a pidfile beside
QEMU — listens on the sandbox's ``agent.sock`` like every other tier's agent does, holds the
one connection to QEMU's chardev socket, and multiplexes: each client request id is mapped to
a relay-wide id on the way in and back on the way out.

Trust: frames from the guest are decoded into the closed guest->host message set before
anything is forwarded; a violation ends the relay (clients see the connection close) and is
logged. Client frames are decoded as host->guest messages too, so nothing malformed reaches
the guest. Ids start at a random offset, so output of requests made before a pause or by a
previous relay can never be mistaken for a current request's.

Run as ``python3 -I -S vmrelay.py CHARDEV_SOCKET LISTEN_SOCKET [UID [QEMU_PID [RESTORE_SOCKET [MOUNTS]]]]``
(stdlib + protocol.py only: it is on every restore's path). With UID it drops to that uid (the
sandbox's own range) once its sockets are open, before it reads a byte from the guest. It exits
when QEMU closes the chardev; when the guest violates the protocol it also kills QEMU_PID (a VM
nobody can reach any more must not run on; as the sandbox's uid it can signal nothing else).

After a restore: every VM restored from one memory image holds the same kernel random state and
the image's wall clock. With RESTORE_SOCKET (QEMU's chardev of the guest's ``warmbox.restore``
port) the relay first writes 64 bytes of host entropy there and waits for the guest's root helper
(wb-restore) to answer (pool credited, crng rekeyed), then sends a fresh reading of the host's
clock and waits for it to be set, then the named volumes to mount (MOUNTS: a file of the block
wb-restore reads, read before the relay drops its uid; zeros: nothing to mount) and waits for each
slot's answer, before it serves any client: no command runs on the old state or before its
volumes are there. It keeps that connection open, so the helper sleeps in poll() meanwhile.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import random
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same file, seen by the type checker under its package name
    from warmbox import protocol as p
else:  # run as a bare script: protocol.py is loaded from beside this package, nothing imported
    _spec = importlib.util.spec_from_file_location(
        "warmbox_relay_protocol",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "protocol.py"),
    )
    p = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(p)

MAX_IDS_PER_CLIENT = 65536  # oldest mappings of a client are forgotten beyond this
CONNECT_TIMEOUT_S = 60.0
MAX_QUEUED = 16 << 20  # bytes pending for one client before the guest's stream waits for it
STALL_S = 30.0  # a client with that much pending that takes nothing for this long is dropped
RESTORE_TIMEOUT_S = 80.0  # a cold boot under TCG reaches the initramfs's helper in ~4 s; a restore at once


def _log(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} relay: {msg}\n")
    sys.stderr.flush()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            if buf:
                raise p.ProtocolViolation("stream closed mid-frame")
            return None
        buf += part
    return bytes(buf)


def read_frame(sock: socket.socket, allowed: tuple[type[p.Message], ...]) -> p.Message | None:
    prefix = _recv_exact(sock, p.PREFIX_SIZE)
    if prefix is None:
        return None
    hlen, blen = p.split_prefix(prefix)
    header = _recv_exact(sock, hlen) if hlen else b""
    body = _recv_exact(sock, blen) if blen else b""
    if header is None or body is None:
        raise p.ProtocolViolation("stream closed mid-frame")
    return p.decode(header, body, allowed)


class Client:
    """One host connection. Frames for it are queued and written by its own thread, so a client
    that reads slowly (a CLI piped into a pager) delays nobody else on the VM's one stream: the
    guest's stream waits only once MAX_QUEUED bytes are pending for one client, and a client that
    takes none of them for STALL_S is disconnected."""

    def __init__(self, relay: Relay, sock: socket.socket) -> None:
        self.relay = relay
        self.sock = sock
        self.cond = threading.Condition()
        self.out: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.ids: collections.OrderedDict[int, int] = collections.OrderedDict()  # client id -> relay id
        self.closed = False

    def send(self, data: bytes) -> None:
        with self.cond:
            deadline = time.monotonic() + STALL_S
            while not self.closed and self.out and self.queued + len(data) > MAX_QUEUED:
                left = deadline - time.monotonic()
                if left <= 0:
                    _log(f"a client took nothing of {self.queued} pending bytes for {STALL_S:.0f} s: disconnected")
                    self._abort()
                    break
                self.cond.wait(left)
            if self.closed:
                return
            self.out.append(data)
            self.queued += len(data)
            self.cond.notify_all()

    def write_forever(self) -> None:
        while True:
            with self.cond:
                while not self.out and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                data = self.out[0]
            try:
                self.sock.sendall(data)
            except OSError:
                with self.cond:
                    self._abort()
                return
            with self.cond:
                if self.out and self.out[0] is data:
                    self.out.popleft()
                    self.queued -= len(data)
                self.cond.notify_all()

    def _abort(self) -> None:
        """Stop sending to this client (caller holds ``cond``); its reader ends on the shutdown."""
        self.closed = True
        self.out.clear()
        self.queued = 0
        self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def serve(self) -> None:
        try:
            while True:
                msg = read_frame(self.sock, p.HOST_TO_GUEST)
                if msg is None:
                    break
                gid = self.ids.get(msg.id)
                if gid is None:
                    gid = self.relay.new_id(self, msg.id)
                    self.ids[msg.id] = gid
                    if len(self.ids) > MAX_IDS_PER_CLIENT:
                        _, old = self.ids.popitem(last=False)
                        self.relay.forget(old)
                cid = msg.id
                msg.id = gid
                try:
                    self.relay.to_guest(p.encode(msg))
                finally:
                    msg.id = cid
        except p.ProtocolViolation as e:
            with self.cond:  # after what is queued, this last frame, then the connection ends
                self.out.append(p.encode(p.Failure(id=0, code=p.ErrorCode.INVALID, message=f"relay: {e}")))
                self.cond.notify_all()
                deadline = time.monotonic() + 5
                while self.out and not self.closed and time.monotonic() < deadline:
                    self.cond.wait(0.1)
        except OSError:
            pass
        finally:
            with self.cond:
                self._abort()
            for gid in self.ids.values():
                self.relay.forget(gid)
            try:
                self.sock.close()
            except OSError:
                pass
            self.relay.drop(self)


class Relay:
    def __init__(self, guest: socket.socket, listener: socket.socket) -> None:
        self.guest = guest
        self.listener = listener
        self.guest_lock = threading.Lock()
        self.routes: dict[int, tuple[Client, int]] = {}
        self.routes_lock = threading.Lock()
        self.clients: set[Client] = set()
        self._next = random.SystemRandom().randrange(1 << 24, 1 << 40)

    def new_id(self, client: Client, cid: int) -> int:
        with self.routes_lock:
            self._next += 1
            self.routes[self._next] = (client, cid)
            return self._next

    def forget(self, gid: int) -> None:
        with self.routes_lock:
            self.routes.pop(gid, None)

    def drop(self, client: Client) -> None:
        with self.routes_lock:
            self.clients.discard(client)

    def to_guest(self, frame: bytes) -> None:
        with self.guest_lock:
            self.guest.sendall(frame)

    def from_guest(self) -> None:
        """Route every guest frame to the client whose request it answers; returns at EOF."""
        while True:
            msg = read_frame(self.guest, p.GUEST_TO_HOST)
            if msg is None:
                return
            if msg.id == 0:  # about the stream, not a request: everyone hears it
                with self.routes_lock:
                    targets = [(c, 0) for c in self.clients]
            else:
                with self.routes_lock:
                    route = self.routes.get(msg.id)
                targets = [route] if route else []
            for client, cid in targets:
                msg.id = cid
                client.send(p.encode(msg))

    def accept_forever(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            client = Client(self, sock)
            with self.routes_lock:
                self.clients.add(client)
            try:
                threading.Thread(target=client.serve, daemon=True).start()
                threading.Thread(target=client.write_forever, daemon=True).start()
            except RuntimeError as e:  # no thread to be had (the VM's pids bound): refuse this one
                _log(f"client refused: {e}")
                with client.cond:
                    client._abort()
                sock.close()
                self.drop(client)


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)


MOUNT_SLOTS, MOUNT_RECORD = 4, 256  # microvm.VOLUME_SLOTS, SLOT_RECORD
_MOUNT_ANSWERS = {
    b"P": "its mount point cannot be had (a symlink or a non-directory on the way, or the microVM's read-only "
    "root image: mount volumes below /workspace, /tmp or /home/user, or at a directory the image has)",
    b"D": "its disk is missing in the guest",
    b"F": "the guest could not mount it (not an ext4 volume?)",
}


def after_restore(sock: socket.socket, timeout: float = RESTORE_TIMEOUT_S, mounts: bytes | None = None) -> str:
    """Host entropy, then (once the guest answered, so the reading is fresh) the host's clock to
    the guest's wb-restore, then the volumes to mount; "" once all were done, else why not."""
    sock.settimeout(timeout)
    try:
        sock.sendall(os.urandom(64))
        answer = sock.recv(1)  # a cold boot's helper starts with the initramfs: seconds
        if answer != b"R":
            return f"the guest's restore helper answered {answer!r} to the entropy"
        sock.settimeout(10.0)
        now = time.time_ns()
        sock.sendall(struct.pack("<qq", now // 1_000_000_000, now % 1_000_000_000))
        answer = sock.recv(1)
        if answer != b"K":
            return f"the guest's restore helper answered {answer!r} to the clock"
        block = mounts if mounts is not None else bytes(MOUNT_SLOTS * MOUNT_RECORD)
        sock.settimeout(30.0)
        sock.sendall(block)
        answers = b""
        while len(answers) < MOUNT_SLOTS:
            got = sock.recv(MOUNT_SLOTS - len(answers))
            if not got:
                return "the guest's restore helper closed the port before answering the volumes"
            answers += got
        for i in range(MOUNT_SLOTS):
            a = answers[i : i + 1]
            want = b"-" if block[i * MOUNT_RECORD] == 0 else b"M"
            if a != want:
                path = block[i * MOUNT_RECORD + 1 : (i + 1) * MOUNT_RECORD].rstrip(b"\0").decode(errors="replace")
                return f"volume at {path}: " + _MOUNT_ANSWERS.get(a, f"the guest answered {a!r}")
    except OSError as e:  # a timeout too
        return f"no answer from the guest's restore helper ({e or 'timed out'})"
    finally:
        sock.settimeout(None)
    return ""


def main(argv: list[str]) -> int:
    chardev, listen_path = argv[:2]
    uid = int(argv[2]) if len(argv) > 2 else None
    qemu_pid = int(argv[3]) if len(argv) > 3 and uid is not None else None
    restore_path = argv[4] if len(argv) > 4 else None
    mounts = None
    if len(argv) > 5:
        with open(argv[5], "rb") as f:
            mounts = f.read(MOUNT_SLOTS * MOUNT_RECORD + 1)
        if len(mounts) != MOUNT_SLOTS * MOUNT_RECORD:
            _log(f"{argv[5]}: not a volume block of {MOUNT_SLOTS * MOUNT_RECORD} bytes")
            return 1
    try:
        os.unlink(listen_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        listener.bind(listen_path)
    finally:
        os.umask(old)
    listener.listen(64)
    try:
        guest = _connect(chardev)
        restore = _connect(restore_path) if restore_path else None
    except OSError as e:
        _log(f"cannot reach QEMU's chardevs {chardev} / {restore_path}: {e}")
        return 1
    if uid is not None:  # both sockets are open: parse the guest's bytes as nobody in particular
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if restore is not None:
        why = after_restore(restore, mounts=mounts)
        if why:
            _log(f"the guest's kernel was not reseeded or its clock not set, relay stops: {why}")
            if qemu_pid:  # nobody will ever be served by this VM
                try:
                    os.kill(qemu_pid, 9)
                except OSError:
                    pass
            return 3
    relay = Relay(guest, listener)
    threading.Thread(target=relay.accept_forever, daemon=True).start()
    try:
        relay.from_guest()
        _log("QEMU closed the agent chardev")
    except p.ProtocolViolation as e:
        _log(f"guest violated the protocol, relay stops: {e}")
        if qemu_pid:
            try:
                os.kill(qemu_pid, 9)
            except OSError:
                pass
    except OSError as e:
        _log(f"agent chardev: {e}")
    try:
        os.unlink(listen_path)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
