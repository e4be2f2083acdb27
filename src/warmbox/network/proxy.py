"""The egress proxy and resolver: the one process sandbox packets can reach (:func:`main` ``HOME``).

One per warmbox home, started on demand by the engine and gone when no sandbox has a link
for a while; a supervisor process restarts it if it dies (see :mod:`warmbox.network.supervisor`). It listens
inside the egress namespace (see :mod:`warmbox.network.netns`) and opens upstream connections
from its own namespace (the host's, or ``network.upstream_netns``).
Per request it finds the sandbox by source address (the nftables table guarantees it is not
spoofed), reads that sandbox's policy from the registry (so a policy update applies to the
next connection), decides the name (by its rules, else by asking: the sandbox's live SDK
callback, else a question in the approval queue, see :mod:`warmbox.network.asks`) and only
then resolves it itself (a name not allowed never reaches the upstream resolver, nor does the
resolver forward one), refuses blocked addresses, and records a flat
:class:`~warmbox.models.NetEvent` for every attempt. Hosts a sandbox holds secrets for are
terminated with that sandbox's CA so the placeholder in a request header can be swapped for
the value; every other TLS connection is tunnelled untouched after an SNI check.

Everything a sandbox sends is hostile: requests are bounded and parsed by llhttp (see
:mod:`warmbox.network.http1`), queries by dnspython (see :mod:`warmbox.network.dns`); a bad
request is a 400 and a closed connection, a bad query a FORMERR, never a crash of the proxy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import ipaddress
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from warmbox import config, paths
from warmbox.errors import ApprovalClosed, ApprovalNotFound, InvalidArgument, WarmboxError
from warmbox.models import Approval, NetEvent
from warmbox.network import asks, dns, netns, nflog
from warmbox.network.http1 import MAX_HEAD, BadRequest, Request, RequestReader
from warmbox.network.policy import Policy, Secret, is_blocked, is_ip, normalize_host, refusal
from warmbox.network.supervisor import (
    PR_SET_PDEATHSIG,
    Supervisor,
    control_path,
    read_pid,
    supervisor_pid_path,
    write_pid,
)
from warmbox.network.tls import SandboxCA
from warmbox.storage.registry import open_registry

HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
IDLE_EXIT_S = 10.0
OWN_REFRESH_S = 10.0  # this host's addresses and the cluster's members are re-read this often
MAX_CONTROL_LINE = 1 << 20
# refused packets (NFLOG): at most this many distinct (sandbox, protocol, destination, port) are held
# between two flushes (more: counted per sandbox, itemised no further), each flush writes one audit
# row per key, and a sandbox gets at most REFUSED_ROWS itemised rows from one proxy; after that one
# row counts the rest. The kernel's side is bounded by netns.LOG_RATE and nflog.RCVBUF.
REFUSED_KEYS = 512
REFUSED_ROWS = 1000
REFUSED_FLUSH_S = 1.0
REFUSED_READS = 64  # datagrams per wakeup, so a flood cannot starve the proxy's other work
DECISIONS = ("allow_once", "allow_always", "deny")
# questions (on_unknown="ask"): distinct host:port questions open at once per sandbox, per tenant
# (so one tenant's many sandboxes cannot crowd out another's) and in all (memory); past them a
# connection is denied unasked ("approval:queue-full"), itemised in the audit log up to
# QUEUE_FULL_ROWS times per sandbox, then counted in one row
ASK_OPEN_PER_SANDBOX = 8
ASK_OPEN_PER_TENANT = 64
ASK_OPEN_TOTAL = 4096
QUEUE_FULL_ROWS = 100


@dataclasses.dataclass
class _Conn:
    sandbox_id: str
    event_id: int = 0
    up: int = 0
    down: int = 0


def parse_sni(hello: bytes) -> str | None:
    """The server name of a TLS ClientHello record, or None (raises BadRequest if malformed)."""
    try:
        if hello[0] != 0x16 or hello[5] != 0x01:
            raise BadRequest("not a TLS ClientHello")
        off = 5 + 4 + 2 + 32
        off += 1 + hello[off]  # session id
        off += 2 + int.from_bytes(hello[off : off + 2], "big")  # cipher suites
        off += 1 + hello[off]  # compression methods
        end = off + 2 + int.from_bytes(hello[off : off + 2], "big")
        off += 2
        while off + 4 <= min(end, len(hello)):
            etype, elen = int.from_bytes(hello[off : off + 2], "big"), int.from_bytes(hello[off + 2 : off + 4], "big")
            off += 4
            if etype == 0:
                if hello[off + 2] != 0:
                    raise BadRequest("SNI is not a host name")
                n = int.from_bytes(hello[off + 3 : off + 5], "big")
                name = hello[off + 5 : off + 5 + n]
                if len(name) != n:
                    raise BadRequest("truncated SNI")
                return name.decode("ascii")
            off += elen
        return None
    except (IndexError, UnicodeDecodeError):
        raise BadRequest("malformed ClientHello") from None


def split_hostport(target: str, default: int) -> tuple[str, int]:
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = target.rpartition(":") if target.count(":") == 1 else (target, "", "")
    if port and not port.isdigit():
        raise BadRequest("bad port")
    p = int(port) if port else default
    if not 0 < p < 65536:
        raise BadRequest("bad port")
    return host, p


def authority(host: str, port: int, default: int) -> str:
    """``host`` (normalised) and ``port`` as a Host header writes them."""
    name = f"[{host}]" if ":" in host else host
    return name if port == default else f"{name}:{port}"


def check_host(request: Request, host: str, port: int, default: int) -> None:
    """A request inside a tunnel must be for the host the tunnel was allowed to: origin-form, with
    one Host naming that host and port. A server on a shared address (a CDN's) routes by Host, so
    another name there would get the request, and the secrets swapped in for ``host``."""
    if not (request.target.startswith("/") or (request.target == "*" and request.method == "OPTIONS")):
        raise BadRequest(
            f"a request inside the tunnel to {host} must be origin-form (a path), not {request.target[:100]!r}"
        )
    values = [v for k, v in request.headers if k.lower() == "host"]
    if len(values) != 1:
        raise BadRequest(f"a request inside the tunnel to {host} needs exactly one Host header, got {len(values)}")
    try:
        name, p = split_hostport(values[0].strip(), default)
        same = normalize_host(name) == host and p == port
    except (BadRequest, InvalidArgument):
        same = False
    if not same:
        raise BadRequest(f"Host {values[0][:100]!r} inside the tunnel is not {authority(host, port, default)}")


async def relay_body(rr: RequestReader, request: Request, writer: asyncio.StreamWriter, conn: _Conn) -> None:
    """Copy one request's body, as llhttp read it (see :mod:`warmbox.network.http1`), to upstream."""
    async for piece in rr.body(request):
        writer.write(piece)
        conn.up += len(piece)
        await writer.drain()


async def pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: _Conn,
    down: bool,
    leave_on_cancel: bool = False,
) -> None:
    """Copy until EOF, then pass the EOF on (also when cancelled, unless ``leave_on_cancel``: then
    ``writer`` is left to its owner, which may still have the proxy's 400 to send on it)."""
    end = True
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if down:
                conn.down += len(data)
            else:
                conn.up += len(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    except asyncio.CancelledError:
        end = not leave_on_cancel
        raise
    finally:
        try:
            if not end:
                pass
            elif writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except (OSError, RuntimeError):
            pass


def _reset_if_client_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0) a connection the sandbox closed first, once nothing is left
    to send it: its side then ends at once instead of in TIME_WAIT, which gVisor (runsc 2022-12)
    cannot checkpoint: a memory pause in the next minute would fail and take the sandbox with it."""
    sock = writer.get_extra_info("socket")
    if sock is None or not reader.at_eof():
        return
    try:
        if writer.transport.get_write_buffer_size():
            return
        unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        if unsent == 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, RuntimeError):
        pass


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass


class Proxy:
    def __init__(self, home: Path, settings: config.Settings, keeper: socket.socket | None = None) -> None:
        self.home = home
        self.keeper = keeper  # to the supervisor, which keeps the registrations for a restart
        self.net = settings.network
        self.approvals = settings.approvals
        self.cluster = settings.cluster
        self.registry = open_registry(home, settings)  # links: this node's
        self.secrets: dict[str, list[tuple[str, Secret]]] = {}  # sandbox -> [(placeholder, secret)]
        self.cas: dict[str, SandboxCA] = {}
        self.approvers: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self.pending: dict[int, asyncio.Future[str]] = {}
        self.asking: dict[tuple[str, str, int], asyncio.Future[tuple[bool, str]]] = {}
        self.tasks: dict[str, set[asyncio.Task]] = {}
        self.watch: asks.AnswerWatch | None = None  # the approval queue's answers (see serve())
        # question -> (its open row in the approval queue, kind, deadline)
        self.queued: dict[tuple[str, str, int], tuple[str, str, float]] = {}
        self.handovers: set[asyncio.Task] = set()  # queued questions asked of a late SDK subscriber
        self.tenants: dict[str, str] = {}  # sandbox -> its tenant, for the bound on open questions
        self.queue_full: dict[str, tuple[int, int, int]] = {}  # sandbox -> (rows, its count row, past them)
        self.own: set[str] = set()
        self.sni: dict[int, str] = {}
        self.last_control = time.monotonic()
        self.next_req = 0
        self.stopping = asyncio.Event()
        self.refused: dict[tuple[str, str, str, int], int] = {}  # bounded by REFUSED_KEYS
        self.refused_over: dict[str, int] = {}  # source -> packets past REFUSED_KEYS (bounded too)
        self.refused_lost = 0
        self.refused_rows: dict[str, int] = {}  # sandbox -> itemised rows written (<= REFUSED_ROWS)
        self.refused_capped: dict[str, tuple[int, int]] = {}  # sandbox -> (its cap row, packets counted)
        self.upstream_ssl = ssl.create_default_context(cafile=self.net.upstream_ca or None)

    # ---- refused packets (NFLOG): see nflog.py and the REFUSED_* bounds

    def read_refused(self, sock: socket.socket) -> None:
        for _ in range(REFUSED_READS):
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: the kernel's queue overflowed and dropped some
                self.refused_lost += 1
                continue
            for p in nflog.parse(data):
                key = (p.source, p.protocol, p.destination, p.port)
                n = self.refused.get(key)
                if n is None and len(self.refused) >= REFUSED_KEYS:
                    if p.source in self.refused_over or len(self.refused_over) < REFUSED_KEYS:
                        self.refused_over[p.source] = self.refused_over.get(p.source, 0) + 1
                    continue
                self.refused[key] = (n or 0) + 1

    async def flush_refused_loop(self) -> None:
        while True:
            await asyncio.sleep(REFUSED_FLUSH_S)
            self.flush_refused()

    def flush_refused(self) -> None:
        """Audit what was refused since the last flush: one deny row per (protocol, destination,
        port) of a sandbox, then its cap row once it had REFUSED_ROWS."""
        held, over, lost = self.refused, self.refused_over, self.refused_lost
        self.refused, self.refused_over, self.refused_lost = {}, {}, 0
        if not held and not over:
            return
        now = time.time()
        owners: dict[str, str | None] = {}

        def owner(address: str) -> str | None:
            if address not in owners:
                found = self.policy_of(address)
                owners[address] = found[0] if found is not None else None
            return owners[address]

        rows: list[NetEvent] = []
        capped: dict[str, int] = dict(over)
        for (src, proto, dst, port), n in held.items():
            sid = owner(src)
            if sid is None:
                continue
            if self.refused_rows.get(sid, 0) >= REFUSED_ROWS:
                capped[src] = capped.get(src, 0) + n
                continue
            self.refused_rows[sid] = self.refused_rows.get(sid, 0) + 1
            rule = "raw-ip" if dst != netns.GATEWAY else "port-not-allowed"
            detail = f"{n} packet{'s' if n > 1 else ''} refused by the egress rules (not via the proxy)"
            rows.append(NetEvent(sid, now, proto, "", dst, port, "deny", rule, 0, 0, detail))
        if lost:
            print(f"warmbox proxy: {lost} reads of refused packets overflowed", file=sys.stderr, flush=True)
        try:
            if rows:
                self.registry.egress.add_net_events(rows)
            for src, n in capped.items():
                sid = owner(src)
                if sid is not None:
                    self._count_capped(sid, n, now)
        except WarmboxError:
            pass

    def _count_capped(self, sid: str, n: int, now: float) -> None:
        """One row per sandbox counts the refused packets past its itemised ones."""
        total = self.refused_capped.get(sid, (0, 0))[1] + n
        detail = (
            f"{total} more packets refused by the egress rules, not itemised (audit bound: "
            f"{REFUSED_ROWS} rows; logging is rate-limited to {netns.LOG_RATE} per sandbox)"
        )
        event_id = self.refused_capped.get(sid, (0, 0))[0]
        if event_id:
            self.registry.egress.deny_net_event(event_id, "audit-bound", detail)
        else:
            event_id = self.registry.egress.add_net_event(
                NetEvent(sid, now, "ip", "", "", 0, "deny", "audit-bound", 0, 0, detail)
            )
        self.refused_capped[sid] = (event_id, total)

    # ---- bookkeeping

    def audit(
        self, sid: str, kind: str, host: str, address: str, port: int, decision: str, rule: str, detail: str = ""
    ) -> int:
        try:
            return self.registry.egress.add_net_event(
                NetEvent(sid, time.time(), kind, host, address, port, decision, rule, 0, 0, detail)
            )
        except WarmboxError:
            return 0

    def audit_queue_full(self, sid: str, kind: str, host: str, port: int, detail: str) -> None:
        """A connection denied unasked (too many open questions): itemised QUEUE_FULL_ROWS times
        per sandbox, then one row counts the rest (a flood of names cannot flood the log)."""
        rows, event_id, past = self.queue_full.get(sid, (0, 0, 0))
        if rows < QUEUE_FULL_ROWS:
            self.queue_full[sid] = (rows + 1, event_id, past)
            self.audit(sid, kind, host, "", port, "deny", "approval:queue-full", detail)
            return
        past += 1
        text = (
            f"{past} more connections denied unasked while too many questions were open, not itemised "
            f"(audit bound: {QUEUE_FULL_ROWS} rows; the last: {host}:{port})"
        )
        try:
            if event_id:
                self.registry.egress.deny_net_event(event_id, "approval:queue-full", text)
            else:
                event_id = self.audit(sid, kind, "*", "", 0, "deny", "approval:queue-full", text)
        except WarmboxError:
            pass
        self.queue_full[sid] = (rows, event_id, past)

    def finish(self, conn: _Conn, detail: str = "") -> None:
        if conn.event_id:
            try:
                self.registry.egress.finish_net_event(conn.event_id, conn.up, conn.down, detail)
            except WarmboxError:
                pass

    def keep(self, msg: dict) -> None:
        """Tell the supervisor (it replays registrations into a restarted proxy; memory only)."""
        if self.keeper is None:
            return
        try:
            self.keeper.sendall((json.dumps(msg) + "\n").encode())
        except OSError as e:
            print(f"warmbox proxy: cannot reach the supervisor ({e}); {msg.get('op')} not kept", file=sys.stderr)

    def restore(self, entries: list[dict]) -> None:
        """Take back the registrations of a proxy that died (for sandboxes still linked)."""
        for entry in entries:
            sid = str(entry["sandbox_id"])
            try:
                if self.registry.egress.link(sid) is None:
                    self.keep({"op": "forget", "sandbox_id": sid})
                    continue
            except WarmboxError:
                pass
            self.secrets[sid] = [(str(x["placeholder"]), Secret(x["value"], x["hosts"])) for x in entry["secrets"]]
            if entry.get("ca"):
                self.cas[sid] = _restore_ca(self.home / "proxy" / sid, *entry["ca"])

    def policy_of(self, address: str) -> tuple[str, Policy] | None:
        try:
            row = self.registry.egress.link_by_address(address)
        except WarmboxError:
            return None
        if row is None:
            return None
        try:
            return row[0], Policy.from_json(row[1])
        except (ValueError, KeyError, TypeError):
            return row[0], Policy("none")

    def refresh_own(self) -> None:
        """The addresses no sandbox may reach whatever its policy: this host's own and, on a
        cluster node, every member's of the cluster (its nodes' API hosts, the Ray head, the
        registry's host): from another node's sandbox, a public or IPv6 node address is not
        private, and behind it are the node API, Ray's GCS and raylets, PostgreSQL."""
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True).stdout
        own = set()
        try:
            for link in json.loads(out or "[]"):
                for a in link.get("addr_info", []):
                    own.add(str(a.get("local", "")))
        except ValueError:
            pass
        try:
            nodes = [n.address for n in self.registry.nodes.nodes()]  # none on one host
        except WarmboxError:
            nodes = []  # the registry does not answer this round: what was blocked stays blocked
            own |= self.own
        self.own = own | cluster_members(nodes, self.cluster)

    # ---- decisions

    async def _lookup(self, host: str) -> list[str]:
        """The upstream addresses of ``host``: call only for a name a rule or an approval allows."""
        out = []
        asked = [dns.query(self.net.resolvers(), host, qtype, timeout=2.0) for qtype in (dns.A, dns.AAAA)]
        for got in await asyncio.gather(*asked, return_exceptions=True):  # both at once: one round trip
            if isinstance(got, BaseException):
                if not isinstance(got, (OSError, TimeoutError, ValueError)):
                    raise got
                continue
            out += got[1]
        return out

    def blocked(self, address: str) -> bool:
        return is_blocked(address) or address in self.own

    async def decide(self, sid: str, pol: Policy, host: str, port: int, kind: str) -> tuple[bool, str, str, str]:
        """(allowed, rule, address to connect to, detail).

        The name is decided (by a rule, else by asking) before it is resolved: a
        name that is not allowed never reaches the upstream resolver.
        """
        verdict, rule = pol.decide_name(host)
        if verdict == "deny":
            return False, rule, "", ""
        if is_ip(host):
            if self.blocked(host):
                return False, "blocked-address", host, ""
            if verdict == "ask":
                ok, rule, detail = await self.ask(sid, host, port, kind)
                if not ok:
                    return False, rule, host, detail
            return True, rule, host, ""
        if verdict == "ask":
            ok, rule, detail = await self.ask(sid, host, port, kind)
            if not ok:
                return False, rule, "", detail
        addrs = await self._lookup(host)
        if not addrs:
            return False, "unresolvable", "", ""
        usable = [a for a in addrs if not self.blocked(a)]
        if not usable:
            return False, "blocked-address", addrs[0], f"{host} resolves only to blocked addresses {addrs[:4]}"
        refused = [pol.denies_address(a) for a in usable]
        if all(refused):
            return False, refused[0], usable[0], f"{host} resolves only to denied addresses {usable[:4]}"
        usable = [a for a, r in zip(usable, refused, strict=True) if not r]
        v4 = [a for a in usable if ":" not in a]
        return True, rule, (v4 or usable)[0], ""

    async def ask(self, sid: str, host: str, port: int, kind: str) -> tuple[bool, str, str]:
        """(allowed, rule, detail) for a destination outside the sandbox's rules (on_unknown="ask").

        Connections to the same host:port share one open question; a sandbox has at most
        ASK_OPEN_PER_SANDBOX open, its tenant ASK_OPEN_PER_TENANT (the proxy ASK_OPEN_TOTAL), so
        dialling many names cannot flood whoever answers: the rest are denied at once
        ("approval:queue-full").
        """
        key = (sid, host, port)
        fut = self.asking.get(key)
        if fut is None:
            bound = self._over_bound(sid)
            if bound:
                return False, "approval:queue-full", f"not asked: {bound}"
            fut = self.asking[key] = asyncio.ensure_future(self._ask(sid, host, port, kind))
            fut.add_done_callback(lambda _f: self.asking.pop(key, None))
        ok, rule = await asyncio.shield(fut)
        return ok, rule, ""

    def _over_bound(self, sid: str) -> str:
        """Why ``sid`` may not open one more question ("" if it may)."""
        tenant = self.tenant_of(sid)
        mine = theirs = 0
        for s, _, _ in self.asking:
            mine += s == sid
            theirs += self.tenants.get(s) == tenant
        if mine >= ASK_OPEN_PER_SANDBOX:
            return f"{mine} questions of this sandbox are open (at most {ASK_OPEN_PER_SANDBOX})"
        if theirs >= ASK_OPEN_PER_TENANT:
            return f"{theirs} questions of its tenant's sandboxes are open (at most {ASK_OPEN_PER_TENANT})"
        if len(self.asking) >= ASK_OPEN_TOTAL:
            return f"{len(self.asking)} questions are open on this host (at most {ASK_OPEN_TOTAL})"
        return ""

    def tenant_of(self, sid: str) -> str:
        """The sandbox's tenant ("": the host's), read once (it never changes)."""
        if sid not in self.tenants:
            try:
                self.tenants[sid] = self.registry.sandboxes.sandbox_tenant(sid) or ""
            except WarmboxError:
                return ""
        return self.tenants[sid]

    async def _ask(self, sid: str, host: str, port: int, kind: str) -> tuple[bool, str]:
        """Ask the sandbox's live SDK subscriber, else put the question in the approval queue."""
        timeout = self.net.approval_timeout_s
        if self.approvers.get(sid):
            try:
                answer = await self._ask_subscriber(sid, host, port, kind, timeout)
            except (TimeoutError, OSError, ConnectionError):
                return False, "approval:timeout"
        else:
            answer = await self._queue(sid, host, port, kind, timeout)
            if not answer:
                return False, "approval:timeout"
        if answer not in DECISIONS:
            return False, "approval:invalid-answer"
        if answer == "deny":
            return False, "approval:deny"
        if answer == "allow_always":
            got = self.registry.egress.link(sid)
            if got is not None:
                self.registry.egress.set_policy(sid, Policy.from_json(got[2]).with_allowed(host).to_json())
        return True, f"approval:{answer}"

    async def _ask_subscriber(self, sid: str, host: str, port: int, kind: str, timeout: float) -> str:
        """The answer of the sandbox's last SDK subscriber (TimeoutError, OSError if none came)."""
        _, w = self.approvers[sid][-1]
        self.next_req += 1
        req = self.next_req
        fut = self.pending[req] = asyncio.get_running_loop().create_future()
        try:
            msg = {"op": "ask", "req": req, "sandbox_id": sid, "host": host, "port": port, "kind": kind}
            w.write((json.dumps(msg) + "\n").encode())
            await w.drain()
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.pending.pop(req, None)

    def hand_over(self, sid: str) -> None:
        """An SDK subscriber arrived: it is asked the sandbox's questions already waiting in the
        queue as well (the first answer, its or the queue's, decides)."""
        for (s, host, port), (approval_id, kind, deadline) in list(self.queued.items()):
            if s == sid:
                task = asyncio.ensure_future(self._hand_over(sid, host, port, kind, approval_id, deadline))
                self.handovers.add(task)
                task.add_done_callback(self.handovers.discard)

    async def _hand_over(self, sid: str, host: str, port: int, kind: str, approval_id: str, deadline: float) -> None:
        try:
            answer = await self._ask_subscriber(sid, host, port, kind, max(0.1, deadline - time.time()))
        except (TimeoutError, OSError, ConnectionError, KeyError, IndexError):
            return
        if answer not in DECISIONS:
            answer = "deny"  # as the subscriber path decides an invalid answer
        try:
            self.registry.approvals.answer_approval(approval_id, answer, "sdk callback")
        except WarmboxError:
            return  # answered in the queue first (or gone): that answer stands
        if self.watch is not None:
            self.watch.nudge()

    async def _queue(self, sid: str, host: str, port: int, kind: str, timeout: float) -> str:
        """The decision for one question in the approval queue ("" if none came in ``timeout`` s).

        The row is opened first, so the operator sees it at once; a webhook (``[network]
        approval_webhook``, else ``[approvals] webhook``), if set, is POSTed the question with its
        ``approval_id`` and may decide in its reply (or later, through the API, like any answer).
        """
        assert self.watch is not None  # made by serve() before the proxy serves
        subject = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            row = self.registry.approvals.open_approval(
                self.tenant_of(sid),
                "network",
                subject,
                f"egress ({kind}) to {subject}, which no rule of the sandbox's network policy allows",
                timeout,
                sandbox_id=sid,
                waiter=paths.owner_tag(os.getpid(), self.registry.node),  # the proxy gone: reads as timed out
            )
        except WarmboxError as e:
            print(f"warmbox proxy: cannot queue an approval question: {e}", file=sys.stderr, flush=True)
            return ""
        key = (sid, host, port)
        self.queued[key] = (row.approval_id, kind, row.deadline)
        answered = self.watch.wait(row.approval_id, row.deadline)
        hook: asyncio.Future[str] | None = None
        url, body, wait_s = self._webhook(row, host, port, kind)
        if url:
            hook = asyncio.ensure_future(asyncio.to_thread(_post_json, url, body, wait_s))
        try:
            if hook is not None:
                first: list[asyncio.Future[Any]] = [hook, answered]
                await asyncio.wait(
                    first,
                    timeout=max(0.0, row.deadline - time.time()) + 1,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                decided = _hook_answer(hook)
                if decided and not answered.done():
                    try:
                        self.registry.approvals.answer_approval(row.approval_id, decided, "webhook")
                    except (ApprovalClosed, ApprovalNotFound):
                        pass  # answered (or timed out) first: that answer stands
                    self.watch.nudge()
            final = await asyncio.wait_for(answered, max(0.0, row.deadline - time.time()) + 2 * asks.POLL_S + 1)
        except (TimeoutError, LookupError):  # (the watch settles it at the deadline: not expected)
            self.watch.cancel(row.approval_id, withdraw=False)
            return ""
        except asyncio.CancelledError:
            self.watch.cancel(row.approval_id)
            raise
        finally:
            self.queued.pop(key, None)
            if hook is not None:
                hook.cancel()
        if final.state in ("pending", "timed_out"):  # pending: read at its deadline
            return ""
        return "deny" if final.state == "denied" else final.decision

    def _webhook(self, row: Approval, host: str, port: int, kind: str) -> tuple[str, bytes, float]:
        """(url, body, seconds to wait for its reply) of the webhook told of a queued question,
        or ("", b"", 0) if none is set."""
        left = max(0.1, row.deadline - time.time())
        if self.net.approval_webhook:  # the network's own: its body as before, with the row's id
            body = {
                "approval_id": row.approval_id,
                "sandbox_id": row.sandbox_id,
                "host": host,
                "port": port,
                "kind": kind,
            }
            return self.net.approval_webhook, json.dumps(body).encode(), left
        if self.approvals.webhook:  # the queue's: the row, as for every other question
            return (
                self.approvals.webhook,
                json.dumps(dataclasses.asdict(row)).encode(),
                min(left, self.approvals.webhook_timeout_s),
            )
        return "", b"", 0.0

    # ---- the proxy

    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = (writer.get_extra_info("peername") or ("",))[0]
        found = self.policy_of(peer)
        if found is None:
            _close(writer)
            return
        sid, pol = found
        task = asyncio.current_task()
        assert task is not None  # asyncio.start_server runs each client in its own Task
        self.tasks.setdefault(sid, set()).add(task)
        conn = _Conn(sid)
        upstream: asyncio.StreamWriter | None = None
        try:
            upstream = await self._serve(sid, pol, reader, writer, conn)
        except (BadRequest, ValueError) as e:
            await self._respond(writer, 400, f"bad request: {e}")
            if conn.event_id:
                self.finish(conn, f"bad request: {e}"[:300])
            else:  # refused before its destination was known: audited all the same
                self.audit(sid, "http", "", "", 0, "deny", "bad-request", str(e)[:300])
        except (
            EOFError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            OSError,
            TimeoutError,
            ssl.SSLError,
        ):
            self.finish(conn)
        except asyncio.CancelledError:
            self.finish(conn, "closed: sandbox gone")
        finally:
            self.tasks.get(sid, set()).discard(task)
            _reset_if_client_closed(reader, writer)
            _close(writer)
            if upstream is not None:
                _close(upstream)

    async def _respond(self, writer: asyncio.StreamWriter, code: int, text: str, reason: str = "") -> None:
        # a refusal's reason phrase says why (policy.refusal): pip and curl -v print it, not the body
        reason = reason or {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}.get(code, "Error")
        body = f"warmbox egress proxy: {text}\n".encode()
        try:
            writer.write(
                f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                f"X-Warmbox-Egress: {'deny' if code == 403 else 'error'}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, ConnectionError, RuntimeError):
            pass

    async def _serve(
        self, sid: str, pol: Policy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn
    ) -> asyncio.StreamWriter | None:
        rr = RequestReader(reader)
        req = await rr.head(HEAD_TIMEOUT_S)
        if req is None:
            raise EOFError
        method, target = req.method, req.target
        if method == "CONNECT":
            kind = "connect"
            raw_host, port = split_hostport(target, 443)
        else:
            kind = "http"
            u = urlsplit(target)
            if u.scheme != "http" or not u.hostname:
                raise BadRequest("only absolute http:// URLs and CONNECT are proxied")
            raw_host, port = u.hostname, u.port or 80
        try:
            host = normalize_host(raw_host)
        except InvalidArgument as e:
            raise BadRequest(str(e)) from None
        ok, rule, address, detail = await self.decide(sid, pol, host, port, kind)
        if not ok:
            if rule == "approval:queue-full":
                self.audit_queue_full(sid, kind, host, port, detail)
            else:
                self.audit(sid, kind, host, address, port, "deny", rule, detail)
            why = refusal(host, port, rule)
            await self._respond(
                writer, 403, f"egress to {host}:{port} denied ({rule}): {why}", f"Forbidden by warmbox: {why}"
            )
            return None
        conn.event_id = self.audit(sid, kind, host, address, port, "allow", rule)
        if kind == "connect":
            return await self._tunnel(sid, host, address, port, rr, writer, conn)
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as e:
            self.finish(conn, f"upstream connect failed: {e}")
            await self._respond(writer, 502, f"cannot connect to {host}:{port}")
            return None
        u = urlsplit(target)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        # the Host is the URL's, as RFC 9112 3.2.2 has a proxy do: the client's own (another name
        # on a shared address) would route the request past the host the policy allowed
        keep = [
            (k, v)
            for k, v in req.headers
            if k.lower() not in ("host", "proxy-connection", "proxy-authorization", "connection", "keep-alive")
        ]
        head = [("Host", authority(host, port, 80)), *keep, ("Connection", "close")]
        out = req.encode_head(f"{method} {path} {req.version}", head)
        up_w.write(out)
        conn.up += len(out)
        try:
            await relay_body(rr, req, up_w, conn)
        except BaseException:
            _close(up_w)  # the upstream sees a request cut short, never what followed it
            raise
        await pipe(up_r, writer, conn, down=True)
        self.finish(conn)
        return up_w

    async def _tunnel(
        self,
        sid: str,
        host: str,
        address: str,
        port: int,
        rr: RequestReader,
        writer: asyncio.StreamWriter,
        conn: _Conn,
    ) -> asyncio.StreamWriter | None:
        reader = rr.reader
        intercept = any(s.applies_to(host) for _, s in self.secrets.get(sid, [])) and sid in self.cas
        if intercept and rr.leftover:  # TLS bytes before the answer would bypass the interception
            raise BadRequest("data sent before the tunnel was established")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        if intercept:
            return await self._intercept(sid, host, address, port, reader, writer, conn)
        first = rr.leftover or await asyncio.wait_for(reader.read(16384), HEAD_TIMEOUT_S)
        if not first:
            self.finish(conn, "client sent nothing")
            return None
        if first[0] == 0x16:
            while len(first) < 5 + int.from_bytes(first[3:5], "big") and len(first) < 16384:
                more = await asyncio.wait_for(reader.read(16384), HEAD_TIMEOUT_S)
                if not more:
                    break
                first += more
            sni = parse_sni(first)
            if (sni is not None and normalize_host(sni, "SNI") != host) or (sni is None and not is_ip(host)):
                self._redecide(conn.event_id, "sni-mismatch", f"TLS SNI {sni!r} != CONNECT host {host}")
                return None
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as e:
            self.finish(conn, f"upstream connect failed: {e}")
            return None
        up_w.write(first)
        conn.up += len(first)
        await asyncio.gather(pipe(reader, up_w, conn, down=False), pipe(up_r, writer, conn, down=True))
        self.finish(conn)
        return up_w

    def _redecide(self, event_id: int, rule: str, detail: str) -> None:
        try:
            self.registry.egress.deny_net_event(event_id, rule, detail)
        except WarmboxError:
            pass

    async def _intercept(
        self,
        sid: str,
        host: str,
        address: str,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: _Conn,
    ) -> asyncio.StreamWriter | None:
        ctx = self.cas[sid].server_context(host)
        ctx.sni_callback = self._note_sni
        await asyncio.wait_for(writer.start_tls(ctx), HEAD_TIMEOUT_S)
        sni = self.sni.pop(id(writer.get_extra_info("ssl_object")), None)
        if sni is None or normalize_host(sni, "SNI") != host:
            self._redecide(conn.event_id, "sni-mismatch", f"TLS SNI {sni!r} != CONNECT host {host}")
            return None
        try:
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection(address, port, ssl=self.upstream_ssl, server_hostname=host), CONNECT_TIMEOUT_S
            )
        except (TimeoutError, OSError, ssl.SSLError) as e:
            self.finish(conn, f"upstream TLS to {host} failed: {e}"[:300])
            return None
        down = asyncio.ensure_future(pipe(up_r, writer, conn, down=True, leave_on_cancel=True))
        injected = 0
        rr = RequestReader(reader)  # the requests inside the TLS stream, one after the other (keep-alive)
        try:
            while True:
                req = await rr.head(HEAD_TIMEOUT_S)
                if req is None:
                    break
                check_host(req, host, port, 443)
                out = []
                for k, v in req.headers:
                    for placeholder, secret in self.secrets.get(sid, []):
                        if placeholder in v and secret.applies_to(host):
                            v = v.replace(placeholder, secret.value)
                            injected += 1
                    out.append((k, v))
                head = req.encode_head(f"{req.method} {req.target} {req.version}", out)
                up_w.write(head)
                conn.up += len(head)
                await relay_body(rr, req, up_w, conn)
                if req.upgrade:  # what follows is not HTTP/1 (a WebSocket): passed through as is
                    up_w.write(rr.leftover)
                    conn.up += len(rr.leftover)
                    await pipe(reader, up_w, conn, down=False)
                    break
        except BadRequest:
            down.cancel()  # the upstream's answer is cut too: the client gets the proxy's 400 now
            _close(up_w)
            raise
        finally:
            try:
                if up_w.can_write_eof():
                    up_w.write_eof()
            except (OSError, RuntimeError):
                pass
            await asyncio.wait([down], timeout=60)
            down.cancel()
        self.finish(conn, f"intercepted; {injected} secret header(s) substituted" if injected else "intercepted")
        return up_w

    def _note_sni(self, sslobj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        if name:
            self.sni[id(sslobj)] = name
        return None

    # ---- the resolver

    async def answer_dns(self, transport: asyncio.DatagramTransport, data: bytes, addr: tuple) -> None:
        found = self.policy_of(addr[0])
        if found is None:
            return
        sid, pol = found
        try:
            q = dns.parse_query(data)
        except dns.DnsFormatError as e:
            self.audit(sid, "dns", "", "", 53, "deny", "malformed-query", str(e)[:200])
            answer = dns.format_error(data)
            if answer is not None:
                transport.sendto(answer, addr)
            return
        try:
            name = normalize_host(q.name, "DNS name")
        except InvalidArgument:
            self.audit(sid, "dns", q.name[:200], "", 53, "deny", "bad-name")
            transport.sendto(dns.build_response(q, dns.NXDOMAIN), addr)
            return
        verdict, rule = pol.decide_name(name)
        if verdict != "allow" or is_ip(name):  # only a name a rule allows is ever forwarded
            self.audit(
                sid, "dns", name, "", 53, "deny", "not-a-name" if verdict == "allow" else rule or "not-allowlisted"
            )
            transport.sendto(dns.build_response(q, dns.NXDOMAIN), addr)
            return
        if q.qtype not in (dns.A, dns.AAAA):
            self.audit(sid, "dns", name, "", 53, "deny", f"qtype-{q.qtype}")
            transport.sendto(dns.build_response(q, dns.NOTIMP), addr)
            return
        try:
            rcode, addrs = await dns.query(self.net.resolvers(), name, q.qtype, timeout=2.0)
        except (OSError, TimeoutError, dns.DnsFormatError):
            self.audit(sid, "dns", name, "", 53, "allow", rule, "upstream resolver did not answer")
            transport.sendto(dns.build_response(q, dns.SERVFAIL), addr)
            return
        usable = [a for a in addrs if not self.blocked(a)]
        refused = [pol.denies_address(a) for a in usable]
        if addrs and not usable:
            self.audit(sid, "dns", name, addrs[0], 53, "deny", "blocked-address", f"answers {addrs[:4]} withheld")
        elif usable and all(refused):
            self.audit(sid, "dns", name, usable[0], 53, "deny", refused[0], f"answers {usable[:4]} withheld")
            usable = []
        else:
            usable = [a for a, r in zip(usable, refused, strict=True) if not r]
            self.audit(sid, "dns", name, usable[0] if usable else "", 53, "allow", rule)
        transport.sendto(
            dns.build_response(q, rcode if rcode in (dns.NOERROR, dns.NXDOMAIN) else dns.SERVFAIL, usable), addr
        )

    # ---- control (engine and SDK processes of this host, via a root-only unix socket)

    async def serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subscribed: str | None = None
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                self.last_control = time.monotonic()
                try:
                    msg = json.loads(line)
                    reply = self.control(msg, reader, writer)
                except (ValueError, KeyError, TypeError, InvalidArgument) as e:
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                if reply is None:  # an approval answer
                    continue
                if msg.get("op") == "approvals" and reply.get("ok"):
                    subscribed = msg["sandbox_id"]
                writer.write((json.dumps(reply) + "\n").encode())
                await writer.drain()
        except (OSError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            if subscribed is not None:
                subs = self.approvers.get(subscribed, [])
                self.approvers[subscribed] = [s for s in subs if s[1] is not writer]
            _close(writer)

    def control(self, msg: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict | None:
        op = msg.get("op")
        if "req" in msg and "decision" in msg:
            fut = self.pending.get(int(msg["req"]))
            if fut is not None and not fut.done():
                fut.set_result(str(msg["decision"]))
            return None
        if op == "hello":
            return {"ok": not self.stopping.is_set(), "pid": os.getpid()}
        if op == "register":
            sid = str(msg["sandbox_id"])
            entries = [(str(s["placeholder"]), Secret(s["value"], s["hosts"])) for s in msg.get("secrets", [])]
            self.secrets[sid] = entries
            ca_pem = ""
            kept: list[str] | None = None
            if entries:
                ca = self.cas.get(sid) or SandboxCA(sid, self.home / "proxy" / sid)
                self.cas[sid] = ca
                ca_pem = ca.cert_pem
                kept = _ca_pems(ca)
            self.keep({"op": "register", "sandbox_id": sid, "secrets": msg.get("secrets", []), "ca": kept})
            return {"ok": True, "ca_pem": ca_pem}
        if op == "forget":
            sid = str(msg["sandbox_id"])
            self.keep({"op": "forget", "sandbox_id": sid})
            self.secrets.pop(sid, None)
            gone = self.cas.pop(sid, None)
            if gone is not None:
                gone.close()
            for _, w in self.approvers.pop(sid, []):
                _close(w)
            for t in self.tasks.pop(sid, set()):
                t.cancel()
            for key, question in list(self.asking.items()):
                if key[0] == sid:
                    question.cancel()
            for key, (approval_id, _, _) in list(self.queued.items()):
                if key[0] == sid:  # withdrawn now: whoever reads the queue next sees no dead question
                    asks.close(self.registry, approval_id)
            self.queue_full.pop(sid, None)
            self.tenants.pop(sid, None)
            self.refused_rows.pop(sid, None)
            self.refused_capped.pop(sid, None)
            return {"ok": True}
        if op == "approvals":
            self.approvers.setdefault(str(msg["sandbox_id"]), []).append((reader, writer))
            self.hand_over(str(msg["sandbox_id"]))
            return {"ok": True}
        if op == "approval_answered":  # a row of the approval queue was answered: look now
            if self.watch is not None:
                self.watch.nudge()
            return {"ok": True}
        if op == "stop":
            self.stopping.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def idle_watch(self) -> None:
        refreshed = time.monotonic()
        while not self.stopping.is_set():
            await asyncio.sleep(1.0)
            try:
                live = self.registry.egress.live_links()
            except WarmboxError:
                continue
            if not live and time.monotonic() - self.last_control > IDLE_EXIT_S and not self.approvers:
                self.stopping.set()
            if time.monotonic() - refreshed > OWN_REFRESH_S:  # the host's addresses, the cluster's nodes
                self.refresh_own()
                refreshed = time.monotonic()


def cluster_members(addresses: list[str], cluster: config.ClusterSettings) -> set[str]:
    """The IP addresses of a cluster's members: the hosts of its nodes' API ``addresses`` (URLs
    or HOST:PORT), of the Ray head (``[cluster] ray``) and of the registry's PostgreSQL URL; a
    name is resolved here (a member whose name does not resolve now is skipped)."""
    hosts: set[str] = set()
    for a in addresses:
        if a.startswith("unix:"):
            continue
        url = urlsplit(a if "://" in a else f"//{a}")
        hosts.add(url.hostname or "")
    if cluster.ray:
        hosts.add(urlsplit("//" + cluster.ray.removeprefix("ray://")).hostname or "")
    if cluster.registry.startswith(("postgresql://", "postgres://")):
        url = urlsplit(cluster.registry)
        for h in [url.hostname or "", *parse_qs(url.query).get("host", [])]:
            hosts.update(x.strip() for x in h.split(","))
    out: set[str] = set()
    for h in hosts:
        if not h or h.startswith("/"):  # no host, or PostgreSQL's unix socket directory
            continue
        try:
            out.add(str(ipaddress.ip_address(h.strip("[]"))))
            continue
        except ValueError:
            pass
        try:
            out.update(str(ai[4][0]).split("%")[0] for ai in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP))
        except OSError:
            continue
    return out


def _ca_pems(ca: SandboxCA) -> list[str]:
    """[key PEM, certificate PEM] of a sandbox CA, for the supervisor's in-memory copy.

    Reaches into SandboxCA (``_key``, ``_cert``, ``_contexts``): tls.py has no export/import of
    its own; tests/network/test_supervision.py checks the round trip.
    """
    key = ca._key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return [key.decode(), ca.cert_pem]


def _restore_ca(directory: Path, key_pem: str, cert_pem: str) -> SandboxCA:
    """The SandboxCA whose key and certificate :func:`_ca_pems` exported (the sandbox trusts it)."""
    ca = SandboxCA.__new__(SandboxCA)
    ca.dir = directory
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = serialization.load_pem_private_key(key_pem.encode(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):  # _ca_pems only writes the CA's own EC key
        raise ValueError(f"the kept CA key is {type(key).__name__}, not an EC key")
    ca._key = key
    ca._cert = x509.load_pem_x509_certificate(cert_pem.encode())
    ca._contexts = {}
    return ca


def _hook_answer(hook: asyncio.Future[str]) -> str:
    """The webhook's decision, if it replied with one ("" if it failed, is still running or said nothing)."""
    if not hook.done() or hook.cancelled() or hook.exception() is not None:
        return ""
    answer = hook.result()
    return answer if answer in DECISIONS else ""


def _post_json(url: str, body: bytes, timeout: float) -> str:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:  # an operator-configured URL
        answer = json.loads(r.read(65536))
    return str(answer.get("decision", "")) if isinstance(answer, dict) else ""


class _Dns(asyncio.DatagramProtocol):
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.DatagramTransport | None = None
        self.inflight = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if self.inflight >= 256 or self.transport is None:
            return  # bounded: a query flood is dropped, not queued
        self.inflight += 1
        task = asyncio.ensure_future(self.proxy.answer_dns(self.transport, data, addr))
        task.add_done_callback(lambda _t: setattr(self, "inflight", self.inflight - 1))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve(argv[1:])
    home = Path(argv[0])
    from warmbox.paths import runtime_dir

    egress = netns.egress_name(runtime_dir(home))
    lock_fd = os.open(home / "netproxy.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another supervisor serves this home
    prior = read_pid(supervisor_pid_path(home))  # left only by one that did not get to stop
    (home / "netproxy.pid").unlink(missing_ok=True)
    asyncio.run(netns.ensure_egress(egress))
    own_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    netns.setns(netns.netns_path(egress))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((netns.GATEWAY, netns.PROXY_PORT))
    tcp.listen(512)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((netns.GATEWAY, netns.DNS_PORT))
    refused: list[socket.socket] = []
    try:  # the packets the egress rules refuse (raw IPs, other ports), for the audit log
        refused.append(nflog.open_socket())
    except OSError as e:
        print(f"warmbox proxy: refused packets are not audited (NFLOG: {e})", file=sys.stderr, flush=True)
    netns.setns(f"/proc/self/fd/{own_ns}")
    os.close(own_ns)
    ctl_path = control_path(home)
    ctl_path.unlink(missing_ok=True)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        ctl.bind(str(ctl_path))
    finally:
        os.umask(old)
    ctl.listen(128)
    write_pid(supervisor_pid_path(home), os.getpid())
    sup = Supervisor(home, [tcp, udp, ctl, *refused])
    # Linked sandboxes at a fresh start: their proxy died with its supervisor, or gave up
    # (an attach starts the proxy before it records its link), so egress was down for them.
    if prior is not None:
        sup.log(f"the previous supervisor (pid {prior}) ended without stopping; starting again")
    sup.audit_outage(
        "proxy-restart",
        (
            f"the egress proxy's supervisor (pid {prior}) died, and the proxy with it"
            if prior is not None
            else "the egress proxy was down"
        )
        + f"; started again as supervisor pid {os.getpid()} (secrets registered before are lost: "
        f"their placeholders are sent unchanged)",
    )
    rc = 1
    try:
        rc = sup.run()
    finally:
        for x in (tcp, udp, ctl, *refused):
            x.close()
        ctl_path.unlink(missing_ok=True)
        (home / "netproxy.pid").unlink(missing_ok=True)
        if rc == 0:  # a clean stop: nothing is linked any more (or `warmbox down` asked)
            asyncio.run(netns.remove_egress(egress))
        supervisor_pid_path(home).unlink(missing_ok=True)
    return rc


def serve(argv: list[str]) -> int:
    """The proxy proper, a child of the supervisor: ``--serve HOME SUPERVISOR_PID TCP,UDP,CTL[,NFLOG],KEEPER``."""
    home, parent = Path(argv[0]), int(argv[1])
    fds = [int(x) for x in argv[2].split(",")]
    tcp_fd, udp_fd, ctl_fd, keeper_fd = fds[0], fds[1], fds[2], fds[-1]
    nflog_fd = fds[3] if len(fds) == 5 else None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        return 1  # the supervisor is gone already
    settings = config.load(home)
    if settings.network.upstream_netns:
        netns.setns(netns.netns_path(settings.network.upstream_netns))
    tcp = socket.socket(fileno=tcp_fd)
    udp = socket.socket(fileno=udp_fd)
    ctl = socket.socket(fileno=ctl_fd)
    keeper = socket.socket(fileno=keeper_fd)
    refused = socket.socket(fileno=nflog_fd) if nflog_fd is not None else None
    keeper.settimeout(10)
    with keeper.makefile("rb") as f:
        restore = json.loads(f.readline(1 << 24) or b"{}").get("restore", [])
    keeper.settimeout(2)

    async def run() -> None:
        proxy = Proxy(home, settings, keeper)
        proxy.restore(restore)
        proxy.refresh_own()
        loop = asyncio.get_running_loop()
        answers = proxy.watch = asks.AnswerWatch(proxy.registry.location, loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, proxy.stopping.set)
        server = await asyncio.start_server(proxy.serve_client, sock=tcp, limit=MAX_HEAD)
        await loop.create_datagram_endpoint(lambda: _Dns(proxy), sock=udp)
        control = await asyncio.start_unix_server(proxy.serve_control, sock=ctl, limit=MAX_CONTROL_LINE)
        if refused is not None:
            refused.setblocking(False)
            loop.add_reader(refused, proxy.read_refused, refused)
        proxy.keep({"op": "ready", "pid": os.getpid()})
        watch = asyncio.ensure_future(proxy.idle_watch())
        flusher = asyncio.ensure_future(proxy.flush_refused_loop())
        await proxy.stopping.wait()
        if refused is not None:
            loop.remove_reader(refused)
        flusher.cancel()
        proxy.flush_refused()
        watch.cancel()
        control.close()
        server.close()
        for tasks in proxy.tasks.values():
            for t in tasks:
                t.cancel()
        for ca in proxy.cas.values():
            ca.close()
        answers.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
