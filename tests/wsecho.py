"""A WebSocket echo server to run inside a sandbox (tests of the ports' WebSocket relay)."""

# A WebSocket echo server for the sandbox (stdlib only): its first message says what the upgrade
# request carried (path, credential headers); then each message comes back as it went, "big" gets
# a 2 MiB answer, "frags" a message in 5,002 frames, "bye" a close with code 4001; a plain GET
# gets a page with a script.
WS_ECHO = r"""
import base64, hashlib, json, socket, struct, threading
def exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def send(c, op, data):
    n = len(data)
    head = bytes([0x80 | op]) + (bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 65536
                                  else bytes([127]) + struct.pack("!Q", n))
    c.sendall(head + data)
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    lines = head.decode().split("\r\n")
    hdr = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
    if "sec-websocket-key" not in hdr:
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<script>document.title = 1</script>")
        return
    key = hdr["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    accept = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
    answer = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    answer += "Sec-WebSocket-Accept: " + accept + "\r\n"
    if hdr.get("sec-websocket-protocol"):
        answer += "Sec-WebSocket-Protocol: " + hdr["sec-websocket-protocol"].split(",")[0].strip() + "\r\n"
    c.sendall((answer + "\r\n").encode())
    secret = ("cookie", "authorization", "x-api-key", "x-access-token", "e2b-traffic-access-token")
    send(c, 1, json.dumps({"path": lines[0].split()[1], "leaked": sorted(k for k in hdr if k in secret)}).encode())
    while True:
        b1, b2 = exact(c, 2)
        op, n = b1 & 15, b2 & 127
        if n == 126:
            n = struct.unpack("!H", exact(c, 2))[0]
        elif n == 127:
            n = struct.unpack("!Q", exact(c, 8))[0]
        mask = exact(c, 4) if b2 & 128 else b"\0\0\0\0"
        data = bytes(x ^ mask[i % 4] for i, x in enumerate(exact(c, n)))
        if op == 8:
            send(c, 8, data[:2])
            return
        if data == b"big":
            send(c, 2, b"x" * (2 << 20))
        elif data == b"frags":
            c.sendall(bytes([0x01, 1]) + b"a" + bytes([0x00, 0]) * 5000 + bytes([0x80, 0]))
        elif data == b"bye":
            send(c, 8, struct.pack("!H", 4001))
        elif op in (1, 2):
            send(c, op, data)
def run(c):
    try:
        serve(c)
    except Exception:
        pass
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8765))
s.listen(16)
while True:
    threading.Thread(target=run, args=(s.accept()[0],), daemon=True).start()
"""

__all__ = ["WS_ECHO"]
