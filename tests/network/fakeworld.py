"""The tests' fake internet; run inside the world namespace the fixture made: ``fakeworld.py DIR``.

Serves (addresses exist only in that namespace):
  198.51.100.10 :80 and :443  allowed.test / api.test: static files from DIR/site, POST echo
  203.0.113.66  :80 and :443  attacker.example.com: accepts uploads
  169.254.169.254 :80         fake cloud metadata
  198.51.100.10 :8080, :8443  a lax keep-alive HTTP/1.1 server (plain, TLS), as a smuggling victim would be
  192.0.2.2     :53/udp       DNS for the names in DIR/zone.json (re-read on every query)
Every request is appended to DIR/<server>.jsonl with its headers and body size (the lax server's
to lax.jsonl, and every byte it receives, per connection, to lax-raw.jsonl).
"""

from __future__ import annotations

import http.server
import json
import re
import socket
import ssl
import struct
import sys
import threading
from pathlib import Path

DIR = Path(sys.argv[1])


def handler(name: str, tls: bool):
    class H(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(DIR / "site"), **kw)

        def log_message(self, *a):
            pass

        def _log(self, body: bytes = b""):
            rec = {
                "method": self.command,
                "path": self.path,
                "headers": dict(self.headers.items()),
                "body": body.decode("latin-1")[:2000],
                "tls": tls,
                "client": self.client_address[0],
            }
            with open(DIR / f"{name}.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

        def do_GET(self):
            self._log()
            if name == "metadata":
                self._reply(b"iam-credentials: AKIA-FAKE-METADATA\n")
                return
            if self.path.startswith("/headers"):
                self._reply(json.dumps(dict(self.headers.items())).encode())
                return
            super().do_GET()

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n)
            self._log(body)
            self._reply(b"received %d bytes\n" % len(body))

        def _reply(self, data: bytes):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return H


def serve(name: str, addr: str, port: int, cert: str | None = None):
    srv = http.server.ThreadingHTTPServer((addr, port), handler(name, cert is not None))
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()


def lax_server(addr: str, port: int, cert: str | None = None) -> None:
    """Reads requests the lax way of servers that smuggling exploits: bare LF ends a line, obs-fold
    continues a header, the first Content-Length decides the body and Transfer-Encoding is ignored;
    it answers each request, and serves what follows a Connection: close that came within 0.5 s."""
    srv = socket.create_server((addr, port))
    ctx = None
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert)

    def serve(conn: socket.socket) -> None:
        raw = b""
        conn.settimeout(20)
        try:
            if ctx is not None:
                conn = ctx.wrap_socket(conn, server_side=True)
            buf = b""
            while True:
                scanned = 0  # (a large body it takes for a head is searched once)
                while (end := re.compile(rb"\r?\n\r?\n").search(buf, scanned)) is None:
                    scanned = max(0, len(buf) - 3)
                    data = conn.recv(65536)
                    if not data:
                        return
                    raw += data
                    buf += data
                head, rest = buf[: end.start()], buf[end.end() :]
                lines = re.sub(rb"\r?\n[ \t]", b" ", head).split(b"\n")
                length, close = None, False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length" and length is None:
                        length = int(value.strip() or b"0")
                    close |= name.strip().lower() == b"connection" and value.strip().lower() == b"close"
                length = length or 0
                while len(rest) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    raw += data
                    rest += data
                body, buf = rest[:length], rest[length:]
                with open(DIR / "lax.jsonl", "a") as f:
                    f.write(json.dumps({"line": lines[0].strip().decode("latin-1"), "body": len(body)}) + "\n")
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                if close and not buf:  # closes once nothing more came within 0.5 s (pipelined bytes are served)
                    conn.settimeout(0.5)
                    try:
                        data = conn.recv(65536)
                    except TimeoutError:
                        return
                    if not data:
                        return
                    raw += data
                    buf += data
                    conn.settimeout(20)
        except (OSError, ValueError):  # (ssl.SSLError is an OSError)
            pass
        finally:
            with open(DIR / "lax-raw.jsonl", "a") as f:
                f.write(json.dumps({"raw": raw.decode("latin-1")}) + "\n")
            conn.close()

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def dns_server():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("192.0.2.2", 53))
    while True:
        data, peer = s.recvfrom(4096)
        try:
            txid, _flags = struct.unpack("!2H", data[:4])
            off, labels = 12, []
            while data[off]:
                labels.append(data[off + 1 : off + 1 + data[off]].decode().lower())
                off += 1 + data[off]
            qtype = struct.unpack("!H", data[off + 1 : off + 3])[0]
            question = data[12 : off + 5]
        except (IndexError, struct.error, UnicodeDecodeError):
            continue
        name = ".".join(labels)
        with open(DIR / "dns.jsonl", "a") as f:
            f.write(json.dumps({"name": name, "qtype": qtype, "client": peer[0]}) + "\n")
        zone = json.loads((DIR / "zone.json").read_text())
        addr = zone.get(name)
        answers = b""
        count = 0
        if addr and qtype == 1:
            answers = b"\xc0\x0c" + struct.pack("!2HIH", 1, 1, 5, 4) + socket.inet_aton(addr)
            count = 1
        rcode = 0 if addr else 3
        s.sendto(struct.pack("!6H", txid, 0x8180 | rcode, 1, count, 0, 0) + question + answers, peer)


if __name__ == "__main__":
    serve("allowed", "198.51.100.10", 80)
    serve("allowed", "198.51.100.10", 443, str(DIR / "allowed.pem"))
    serve("attacker", "203.0.113.66", 80)
    serve("attacker", "203.0.113.66", 443, str(DIR / "attacker.pem"))
    serve("metadata", "169.254.169.254", 80)
    threading.Thread(target=dns_server, daemon=True).start()
    threading.Thread(target=lax_server, args=("198.51.100.10", 8080), daemon=True).start()
    threading.Thread(target=lax_server, args=("198.51.100.10", 8443, str(DIR / "allowed.pem")), daemon=True).start()
    (DIR / "ready").write_text("ok")
    threading.Event().wait()
