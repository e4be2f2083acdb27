"""PortConnect: one TCP connection relayed to a port on the sandbox's own loopback."""

from __future__ import annotations

import _socket as socket
import errno
import threading

from warmbox import protocol as p
from warmbox.guest.base import _Fail

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


_PORT_CONNECT_S = 5.0  # a connect on the sandbox's own loopback answers at once; a full backlog may not


def _port_socket(port: int) -> socket.socket:
    """A connection to ``port`` on the sandbox's loopback: IPv4 first, then IPv6 (a server bound
    to ::1 only). Nothing but loopback is ever dialled: the tunnel cannot reach out of the sandbox."""
    refused: OSError | None = None
    for family, addr in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port, 0, 0))):
        s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(_PORT_CONNECT_S)
        try:
            s.connect(addr)
        except OSError as e:
            s.close()
            if e.errno in (errno.ECONNREFUSED, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH):
                refused = refused or e
                continue
            if isinstance(e, TimeoutError) or e.errno == errno.ETIMEDOUT:
                raise _Fail(
                    p.ErrorCode.CONNECTION_REFUSED, f"port {port}: no answer within {_PORT_CONNECT_S:g} s"
                ) from None
            raise
        s.settimeout(None)
        return s
    raise _Fail(p.ErrorCode.CONNECTION_REFUSED, f"nothing listens on port {port} in the sandbox ({refused})")


class _Tunnel:
    """The connection side of one PortConnect: a thread sends what the server writes (within the
    host's window); the request's worker writes the host's data into the connection."""

    def __init__(self, conn: Connection, msg: p.PortConnect, sock: socket.socket) -> None:
        self.conn = conn
        self.id = msg.id
        self.window = msg.window
        self.sock = sock
        self.cond = threading.Condition()
        self.sent = self.acked = 0
        self.stopped = False

    def ack(self, n: int) -> None:
        with self.cond:
            self.acked += n
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def pump(self) -> None:
        """Connection -> host until the server's end of data (ChunkEnd), or the tunnel stops."""
        while True:
            with self.cond:
                while not self.stopped and self.window and self.sent - self.acked >= self.window:
                    self.cond.wait()
                if self.stopped or self.conn.closed:
                    return
                room = self.window - (self.sent - self.acked) if self.window else p.CHUNK
            try:
                data = self.sock.recv(min(p.CHUNK, room))
            except OSError:
                data = b""  # a reset: the host sees the end of data
            with self.cond:
                if self.stopped:
                    return
                self.sent += len(data)
            if not data:
                self.conn.send(p.ChunkEnd(id=self.id))
                return
            self.conn.send(p.Chunk(id=self.id, data=data))


def _port_connect(agent: Agent, conn: Connection, msg: p.PortConnect) -> None:
    """Relay one TCP connection to the sandbox's loopback (see protocol.PortConnect)."""
    if not 0 < msg.port < 65536 or msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, f"port must be 1..65535 and window not negative, got {msg.port}")
    inbox = conn.inbox(msg.id)
    tunnel = _Tunnel(conn, msg, _port_socket(msg.port))
    with conn._inbox_lock:
        conn.tunnels[msg.id] = tunnel
    reader: threading.Thread | None = None
    try:
        conn.send(p.Ok(id=msg.id))
        reader = threading.Thread(target=tunnel.pump, name=f"port-{msg.id}", daemon=True)
        try:
            reader.start()
        except RuntimeError:  # the pids limit: no thread for the other direction
            reader = None
            raise _Fail(
                p.ErrorCode.EXEC_FAILED, "the sandbox's process limit is reached: no thread for the tunnel"
            ) from None
        while True:
            item = inbox.get()
            if item is None or isinstance(item, p.Cancel):
                return  # the host went away or ended the tunnel: no answer
            if isinstance(item, p.ReadAck):
                tunnel.ack(item.bytes)
            elif isinstance(item, p.Chunk):
                try:
                    tunnel.sock.sendall(item.data)
                except OSError as e:
                    raise _Fail(
                        p.ErrorCode.CONNECTION_REFUSED, f"port {msg.port}: the connection broke ({e})"
                    ) from None
                conn.send(p.PortAck(id=msg.id, bytes=len(item.data)))
            elif isinstance(item, p.ChunkEnd):
                try:
                    tunnel.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            else:
                raise _Fail(p.ErrorCode.INVALID, f"port tunnel: unexpected {type(item).__name__}")
    finally:
        with conn._inbox_lock:
            conn.tunnels.pop(msg.id, None)
        tunnel.stop()
        if reader is not None:
            reader.join()  # nothing is sent for this id after the handler's own last frame
        tunnel.sock.close()
