"""The HTTP API's route table: one route per operation of :mod:`warmbox.operations`, under ``/v1``.

Both ends read this table: the server (:mod:`warmbox.server`) mounts one handler per route, the
SDK's HTTP transport builds each request's URL from it, and the OpenAPI document is generated from
it with the codec's schemas. Fields named in the path come from the path; the rest come from the
JSON body (``body="json"``), the query string (``body="query"``), or, for file uploads, the query
string with the file's bytes as the raw body (``body="raw"``). Each route declares its answer's
:data:`Kind` (JSON, a run's NDJSON stream, a process followed, a watch, a transcript, a file's bytes
whole or streamed, a WebSocket tunnel; see :data:`KINDS`), and each end dispatches on it once.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from warmbox import operations as ops
from warmbox.operations import Op

PREFIX = "/v1"
Body = Literal["json", "query", "raw"]
Response = Literal["json", "ndjson", "raw", "websocket"]  # the answer's media
Kind = Literal[
    "json",
    "background",
    "detach",
    "run",
    "follow",
    "start_follow",
    "watch",
    "transcript",
    "bytes",
    "file_stream",
    "tunnel",
]

# What each kind of route answers, and its media. Both ends dispatch on a route's kind: the server
# builds the answer (server/app.py), the SDK's HTTP transport reads it (sdk/http.py).
KINDS: dict[Kind, tuple[Response, str]] = {
    "json": ("json", "the result as JSON"),
    "background": ("json", "the result as JSON; a client need not wait for it (sent off the caller's path)"),
    "detach": ("json", "null once the id is checked; the server holds the guest connection, a client sends nothing"),
    "run": (
        "ndjson",
        'output events ({"stdout"}, {"stderr"}, {"display"}, {"progress"}) with stream=1, then {"result"}',
    ),
    "follow": ("ndjson", 'a background process\'s events ({"stdout"|"stderr"}, {"pty"}, {"lost"}), then {"result"}'),
    "start_follow": ("ndjson", '{"pid": int} first (or {"error"}), then as "follow"'),
    "watch": ("ndjson", '{"watching": path}, then {"event"} lines, then {"end": null} or {"error"}'),
    "transcript": ("ndjson", "a transcript's records, one per line (warmbox.transcript)"),
    "bytes": ("raw", "the file's bytes, whole"),
    "file_stream": ("raw", "the bytes as a chunked body (X-Warmbox-Path: the path read); cut short on an error"),
    "tunnel": ("websocket", "a WebSocket (TUNNEL_PROTOCOL); a plain GET gets the checks and an error"),
}


@dataclasses.dataclass(frozen=True)
class Route:
    """One operation's HTTP form."""

    op: Op
    method: str
    path: str  # with {field} placeholders, e.g. /v1/sandboxes/{sandbox_id}
    body: Body = "json"
    kind: Kind = "json"  # what it answers (KINDS)
    streamed: bool = False  # a raw body passed on as it arrives (chunked), never held whole
    idempotent: bool = False  # safe to send again after a dropped connection
    summary: str = ""

    @property
    def response(self) -> Response:
        return KINDS[self.kind][0]

    @property
    def path_fields(self) -> tuple[str, ...]:
        return tuple(re.findall(r"{(\w+)}", self.path))

    def url(self, request: ops.Request[Any]) -> str:
        """This route's path for ``request`` (ids are checked by the server; quoted here)."""
        from urllib.parse import quote

        return self.path.format(**{f: quote(str(getattr(request, f)), safe="") for f in self.path_fields})


_S = f"{PREFIX}/sandboxes/{{sandbox_id}}"

ROUTES: tuple[Route, ...] = (
    Route(Op.CREATE, "POST", f"{PREFIX}/sandboxes", summary="Create a sandbox (pooled, cold, or forked)"),
    Route(
        Op.CREATE_AND_RUN,
        "POST",
        f"{PREFIX}/sandboxes/run",
        kind="run",
        summary="Create a sandbox and run its first code cell (NDJSON stream): one round trip",
    ),
    Route(Op.LIST, "GET", f"{PREFIX}/sandboxes", "query", idempotent=True, summary="List sandboxes"),
    Route(Op.INFO, "GET", _S, "query", idempotent=True, summary="A sandbox's record"),
    Route(Op.KILL, "DELETE", _S, "query", summary="Destroy a sandbox"),
    Route(Op.CONNECT, "POST", f"{_S}/connect", idempotent=True, summary="Attach to a live sandbox"),
    Route(
        Op.DETACH,
        "POST",
        f"{_S}/detach",
        kind="detach",
        idempotent=True,
        summary="Let go of a sandbox without ending it",
    ),
    Route(Op.RESUME, "POST", f"{PREFIX}/sandboxes/{{snapshot}}/resume", summary="Resume a paused sandbox or snapshot"),
    Route(Op.TIMINGS, "GET", f"{_S}/timings", "query", idempotent=True, summary="Stage timings"),
    Route(Op.RECORD_FIRST_COMMAND, "POST", f"{_S}/timings/first_command", kind="background", idempotent=True),
    Route(Op.LOGS, "GET", f"{_S}/logs", "query", idempotent=True, summary="Runtime log tails"),
    Route(Op.METRICS, "GET", f"{_S}/metrics", "query", idempotent=True, summary="Usage and cost"),
    Route(
        Op.METRICS_HISTORY,
        "GET",
        f"{_S}/metrics/history",
        "query",
        idempotent=True,
        summary="Metrics history (a reading every 5 s)",
    ),
    Route(Op.SET_TIMEOUT, "POST", f"{_S}/timeout", idempotent=True, summary="Extend or shorten the lifetime"),
    Route(Op.PING, "POST", f"{_S}/ping", idempotent=True, summary="One round trip to the guest agent"),
    Route(Op.EXEC, "POST", f"{_S}/commands", kind="run", summary="Run a command (NDJSON stream)"),
    Route(Op.COMMANDS_START, "POST", f"{_S}/processes", summary="Start a background command or terminal"),
    Route(Op.COMMANDS_LIST, "GET", f"{_S}/processes", "query", idempotent=True, summary="Running background processes"),
    Route(
        Op.COMMANDS_START_CONNECT,
        "POST",
        f"{_S}/processes/follow",
        kind="start_follow",
        summary="Start a background command or terminal and follow it (NDJSON stream: its pid first)",
    ),
    Route(
        Op.COMMANDS_CONNECT,
        "GET",
        f"{_S}/processes/output",
        "query",
        "follow",
        idempotent=True,
        summary="Follow a background process's output (NDJSON stream)",
    ),
    Route(
        Op.COMMANDS_HISTORY,
        "GET",
        f"{_S}/commands/history",
        "query",
        idempotent=True,
        summary="Recorded commands and code runs with their outcomes",
    ),
    Route(Op.COMMANDS_SEND_STDIN, "POST", f"{_S}/processes/stdin", summary="Write to a background process's stdin"),
    Route(Op.COMMANDS_KILL, "POST", f"{_S}/processes/kill", summary="Signal a process and what it started"),
    Route(Op.PTY_RESIZE, "POST", f"{_S}/processes/resize", idempotent=True, summary="Resize a terminal"),
    Route(Op.RUN_CODE, "POST", f"{_S}/code", kind="run", summary="Run a code cell (NDJSON stream)"),
    Route(Op.CREATE_CONTEXT, "POST", f"{_S}/contexts", summary="Create a code context"),
    Route(Op.REMOVE_CONTEXT, "DELETE", f"{_S}/contexts/{{context}}", "query", summary="Remove a code context"),
    Route(Op.LIST_CONTEXTS, "GET", f"{_S}/contexts", "query", idempotent=True, summary="The code contexts"),
    Route(
        Op.RESTART_CONTEXT,
        "POST",
        f"{_S}/contexts/{{context}}/restart",
        summary="A code context's fresh interpreter (same id, no state)",
    ),
    Route(Op.FILES_READ, "GET", f"{_S}/files/content", "query", "bytes", idempotent=True, summary="Read a file"),
    Route(
        Op.FILES_READ_STREAM,
        "GET",
        f"{_S}/files/stream",
        "query",
        "file_stream",
        idempotent=True,
        summary="Stream a file",
    ),
    Route(Op.FILES_WRITE, "PUT", f"{_S}/files/content", "raw", summary="Write a file (raw body)"),
    Route(
        Op.FILES_WRITE_STREAM,
        "PUT",
        f"{_S}/files/stream",
        "raw",
        streamed=True,
        summary="Write a file (streamed raw body)",
    ),
    Route(Op.FILES_WRITE_MANY, "POST", f"{_S}/files/batch", summary="Write several files (JSON body)"),
    Route(Op.FILES_RENAME, "POST", f"{_S}/files/rename", summary="Rename or move a path"),
    Route(
        Op.FILES_UPLOAD_DIR,
        "PUT",
        f"{_S}/files/tar",
        "raw",
        streamed=True,
        summary="Unpack a tar stream into a directory",
    ),
    Route(
        Op.FILES_DOWNLOAD_DIR,
        "GET",
        f"{_S}/files/tar",
        "query",
        "file_stream",
        idempotent=True,
        summary="A directory as a tar stream",
    ),
    Route(Op.FILES_WATCH, "GET", f"{_S}/files/watch", "query", "watch", summary="Watch a directory (NDJSON events)"),
    Route(Op.FILES_LIST, "GET", f"{_S}/files/list", "query", idempotent=True, summary="List a directory"),
    Route(Op.FILES_STAT, "GET", f"{_S}/files/stat", "query", idempotent=True, summary="Stat a path"),
    Route(Op.FILES_MAKE_DIR, "POST", f"{_S}/files/dir", idempotent=True, summary="Make a directory"),
    Route(Op.FILES_REMOVE, "DELETE", f"{_S}/files", "query", summary="Remove a file or directory"),
    Route(Op.FILES_SIGN_URL, "POST", f"{_S}/files/signed_url", summary="Sign a URL that reads or writes one file"),
    Route(Op.SNAPSHOT, "POST", f"{_S}/snapshots", summary="Snapshot a sandbox"),
    Route(Op.PAUSE, "POST", f"{_S}/pause", summary="Snapshot, then release the sandbox"),
    Route(Op.LIST_SNAPSHOTS, "GET", f"{PREFIX}/snapshots", "query", idempotent=True, summary="List snapshots"),
    Route(Op.DELETE_SNAPSHOT, "DELETE", f"{PREFIX}/snapshots/{{snapshot_id}}", "query", summary="Delete a snapshot"),
    Route(Op.GC_SNAPSHOTS, "POST", f"{PREFIX}/snapshots/gc", summary="Collect unreferenced snapshot blobs (admin)"),
    Route(Op.NETWORK_POLICY, "GET", f"{_S}/network", "query", idempotent=True, summary="Egress policy"),
    Route(Op.NETWORK_UPDATE, "PUT", f"{_S}/network", summary="Replace the egress policy"),
    Route(Op.NETWORK_LOG, "GET", f"{_S}/network/log", "query", idempotent=True, summary="Egress audit log"),
    Route(
        Op.EXPORT,
        "GET",
        f"{_S}/export",
        "query",
        "transcript",
        idempotent=True,
        summary="The sandbox's transcript: one typed record per line (NDJSON)",
    ),
    Route(Op.DOCTOR, "GET", f"{PREFIX}/doctor", "query", idempotent=True, summary="Which tiers this host runs"),
    Route(
        Op.CHOOSE_TIER,
        "POST",
        f"{PREFIX}/tiers/choose",
        idempotent=True,
        summary="The tier for requirements (language, trust, I/O, guest kernel), with reasons",
    ),
    Route(Op.POOLS_LIST, "GET", f"{PREFIX}/pools", "query", idempotent=True, summary="Warm pools"),
    Route(Op.POOLS_RESIZE, "POST", f"{PREFIX}/pools/{{name}}/resize", idempotent=True, summary="Resize a pool (admin)"),
    Route(Op.PORTS_CONNECT, "GET", f"{_S}/tunnel", "query", "tunnel", summary="A TCP connection to a sandbox port"),
    Route(Op.VOLUME_CREATE, "POST", f"{PREFIX}/volumes", summary="Create a named volume"),
    Route(Op.VOLUME_LIST, "GET", f"{PREFIX}/volumes", "query", idempotent=True, summary="List your volumes"),
    Route(Op.VOLUME_GET, "GET", f"{PREFIX}/volumes/{{name}}", "query", idempotent=True, summary="A volume's record"),
    Route(Op.VOLUME_DELETE, "DELETE", f"{PREFIX}/volumes/{{name}}", "query", summary="Delete a volume (not in use)"),
    Route(
        Op.TEMPLATE_BUILD,
        "POST",
        f"{PREFIX}/templates",
        kind="run",
        summary="Build a template (NDJSON progress)",
    ),
    Route(Op.TEMPLATE_LIST, "GET", f"{PREFIX}/templates", "query", idempotent=True, summary="Built templates"),
    Route(Op.TEMPLATE_GET, "GET", f"{PREFIX}/templates/{{name}}", "query", idempotent=True, summary="A built template"),
    Route(Op.TEMPLATE_DELETE, "DELETE", f"{PREFIX}/templates/{{name}}", "query", summary="Remove a template"),
    Route(Op.TEMPLATE_GC, "POST", f"{PREFIX}/templates/gc", summary="Collect unused layers and microVM roots (admin)"),
    Route(Op.APPROVALS_LIST, "GET", f"{PREFIX}/approvals", "query", idempotent=True, summary="The approval queue"),
    Route(
        Op.APPROVAL_ANSWER,
        "POST",
        f"{PREFIX}/approvals/{{approval_id}}",
        summary="Answer an approval question (once)",
    ),
    Route(Op.NODE_DRAIN, "POST", f"{PREFIX}/nodes/{{name}}/drain", summary="Drain a cluster node (admin)"),
)

BY_OP: dict[Op, Route] = {r.op: r for r in ROUTES}

# Not operations: a process's health (it runs) and readiness (it can serve: for a cluster's API
# tier, its registry answers and at least one node is up), for load balancers and orchestrators.
HEALTHZ = "/healthz"
READYZ = "/readyz"

# Not operations: the approval questions of a sandbox's egress proxy (on_unknown="ask"), as a
# stream of questions and one answer per question.
APPROVALS = f"{_S}/network/approvals"
APPROVAL_ANSWER = f"{_S}/network/approvals/{{request_id}}"
DECISIONS = ("allow_once", "allow_always", "deny")

TUNNEL_PROTOCOL = """ports.connect is a WebSocket on its route (a plain GET is refused). The server's first
message is text: {"ok": true} once the connection to the port inside the sandbox is made, or
{"error": {...}} (then it closes). After that, binary messages carry the bytes both ways and a text
message {"eof": true} ends one side's data (a half-close); closing the WebSocket ends the connection."""

# Not an operation: plain HTTP to a port inside the sandbox, proxied through a tunnel per request
# (the preview of a web server the sandbox runs), behind the tenant's key like every route.
PREVIEW = f"{_S}/ports/{{port:int}}/{{path:path}}"
PREVIEW_ROOT = f"{_S}/ports/{{port:int}}"  # the same, for "/" without the trailing slash

# Not an operation: what a URL of files.sign_url names (GET reads the file, PUT or POST writes the
# raw body to it), authenticated by its signature alone: path, username, signer,
# signature_expiration and signature in the query (warmbox.engine.signing).
SIGNED_FILE = f"{_S}/files/signed"

# The header of a create's, a command's or a code run's idempotency key (its idempotency_key field):
# a repeat with the same key gets the first call's result, never a second run (docs/idempotency.md)
IDEMPOTENCY_HEADER = "Idempotency-Key"
KEYED_OPS = (Op.CREATE, Op.EXEC, Op.RUN_CODE, Op.CREATE_AND_RUN)

# Not an operation: Prometheus metrics (text exposition), behind the same keys (server/metrics.py)
METRICS = "/metrics"

__all__ = [
    "APPROVALS",
    "APPROVAL_ANSWER",
    "BY_OP",
    "DECISIONS",
    "IDEMPOTENCY_HEADER",
    "KEYED_OPS",
    "KINDS",
    "METRICS",
    "PREFIX",
    "PREVIEW",
    "ROUTES",
    "SIGNED_FILE",
    "TUNNEL_PROTOCOL",
    "Route",
]
