"""E2B's routes and RPCs, each with the warmbox operations it runs: the one table the adapter
serves, docs/e2b.md shows and tests/e2b/test_routes.py checks against the installed SDKs."""

from __future__ import annotations

import dataclasses

from warmbox.operations import Op


@dataclasses.dataclass(frozen=True)
class Route:
    """One E2B call. plane: "api" (the control plane, key in X-API-KEY), "envd" (port 49983 of a
    sandbox: Connect RPC and plain HTTP), "interpreter" (port 49999: the code interpreter) or "port"
    (any other port: ``get_host(port)``, a server inside the sandbox).
    method: the HTTP method ("POST" for a Connect RPC). path: the route, ``{id}`` for a path
    parameter. ops: the operations it runs, in order; empty with ``unsupported`` set: answered
    with a typed error saying why (never a 404)."""

    plane: str
    method: str
    path: str
    ops: tuple[Op, ...]
    note: str = ""
    unsupported: str = ""


_S = "/sandboxes/{id}"
ROUTES: tuple[Route, ...] = (
    # ---- control plane
    Route(
        "api",
        "POST",
        "/sandboxes",
        (Op.CREATE,),
        "template by name: base, code-interpreter-v1 (pydata); a snapshot's id (snap-...) forks it",
    ),
    Route("api", "POST", "/v2/sandboxes", (Op.CREATE,), "the same body as /sandboxes (e2b >= 2.51)"),
    Route("api", "GET", "/sandboxes", (Op.LIST,), "running ones, as E2B's v1 list"),
    Route("api", "GET", "/v2/sandboxes", (Op.LIST,), "metadata and state filters, limit, x-next-token paging"),
    Route(
        "api",
        "GET",
        "/sandboxes/metrics",
        (Op.METRICS_HISTORY,),
        "each one's latest reading (at most 100 ids); unknown and others' ids are left out",
    ),
    Route("api", "GET", _S, (Op.INFO,)),
    Route("api", "DELETE", _S, (Op.KILL,)),
    Route("api", "POST", _S + "/timeout", (Op.SET_TIMEOUT,)),
    Route("api", "POST", _S + "/pause", (Op.PAUSE,), "409 when already paused; memory where the tier snapshots it"),
    Route("api", "POST", _S + "/connect", (Op.INFO, Op.RESUME, Op.SET_TIMEOUT), "resumes a paused one: same id"),
    Route("api", "POST", "/v2" + _S + "/connect", (Op.INFO, Op.RESUME, Op.SET_TIMEOUT), "as /sandboxes/{id}/connect"),
    Route("api", "POST", _S + "/resume", (Op.RESUME,), "E2B's older resume"),
    Route(
        "api", "GET", _S + "/metrics", (Op.METRICS_HISTORY,), "the readings in [start, end]: every 5 s, the last hour"
    ),
    Route("api", "GET", _S + "/logs", (Op.LOGS,), "the runtime's log tails (redacted), by line; start, limit"),
    Route("api", "GET", "/v2" + _S + "/logs", (Op.LOGS,), "as /logs; cursor, direction, level, search"),
    Route("api", "POST", _S + "/refreshes", (Op.SET_TIMEOUT,), "extends the timeout by `duration` seconds"),
    Route("api", "PUT", _S + "/network", (Op.NETWORK_UPDATE,), "replaced whole: allowOut is the allowlist"),
    Route(
        "api",
        "POST",
        _S + "/fork",
        (Op.SNAPSHOT, Op.CREATE, Op.DELETE_SNAPSHOT),
        "one snapshot, `count` creates from it (each its own result), then the snapshot deleted",
    ),
    Route("api", "POST", _S + "/snapshots", (Op.SNAPSHOT,), "memory where the tier snapshots it; the sandbox runs on"),
    Route("api", "GET", "/snapshots", (Op.LIST_SNAPSHOTS,), "sandboxID and name (an id) filters, x-next-token paging"),
    Route("api", "DELETE", "/templates/{id}", (Op.DELETE_SNAPSHOT,), "a snapshot's id only (delete_snapshot)"),
    # ---- envd: process.Process
    Route(
        "envd",
        "POST",
        "/process.Process/Start",
        (Op.COMMANDS_START_CONNECT,),
        "server stream; one guest request starts and follows it; stdin=false closes stdin at once",
    ),
    Route("envd", "POST", "/process.Process/Connect", (Op.COMMANDS_CONNECT,), "server stream; by pid or tag"),
    Route("envd", "POST", "/process.Process/List", (Op.COMMANDS_LIST,)),
    Route("envd", "POST", "/process.Process/SendInput", (Op.COMMANDS_SEND_STDIN,)),
    Route("envd", "POST", "/process.Process/StreamInput", (Op.COMMANDS_SEND_STDIN,), "client stream"),
    Route("envd", "POST", "/process.Process/CloseStdin", (Op.COMMANDS_SEND_STDIN,), "send_stdin with eof"),
    Route("envd", "POST", "/process.Process/SendSignal", (Op.COMMANDS_KILL,), "SIGKILL or SIGTERM"),
    Route("envd", "POST", "/process.Process/Update", (Op.PTY_RESIZE,), "a terminal's size"),
    # ---- envd: filesystem.Filesystem
    Route("envd", "POST", "/filesystem.Filesystem/Stat", (Op.FILES_STAT,)),
    Route("envd", "POST", "/filesystem.Filesystem/MakeDir", (Op.FILES_MAKE_DIR, Op.FILES_STAT)),
    Route("envd", "POST", "/filesystem.Filesystem/Move", (Op.FILES_RENAME,)),
    Route("envd", "POST", "/filesystem.Filesystem/ListDir", (Op.FILES_LIST,)),
    Route("envd", "POST", "/filesystem.Filesystem/Remove", (Op.FILES_REMOVE,)),
    Route("envd", "POST", "/filesystem.Filesystem/WatchDir", (Op.FILES_WATCH,), "server stream"),
    Route(
        "envd", "POST", "/filesystem.Filesystem/CreateWatcher", (Op.FILES_WATCH,), "events kept in the adapter, bounded"
    ),
    Route("envd", "POST", "/filesystem.Filesystem/GetWatcherEvents", (), "no operation: the watcher's kept events"),
    Route("envd", "POST", "/filesystem.Filesystem/RemoveWatcher", (), "no operation: stops the watch"),
    # ---- envd: plain HTTP
    Route(
        "envd",
        "GET",
        "/files",
        (Op.FILES_READ_STREAM,),
        "?path=, streamed; or a signed URL (E2B's v1 scheme, as files.sign_url signs)",
    ),
    Route(
        "envd",
        "POST",
        "/files",
        (Op.FILES_WRITE_STREAM,),
        "multipart (field file, filename = path) or octet-stream; or a signed URL",
    ),
    Route("envd", "GET", "/health", (), "204, no operation: the server answers for every sandbox"),
    # ---- the code interpreter
    Route("interpreter", "POST", "/execute", (Op.RUN_CODE,), "NDJSON events; `env_vars` for that run only"),
    Route("interpreter", "POST", "/contexts", (Op.CREATE_CONTEXT,)),
    Route("interpreter", "DELETE", "/contexts/{id}", (Op.REMOVE_CONTEXT,)),
    Route("interpreter", "GET", "/contexts", (Op.LIST_CONTEXTS,), "the default contexts once they ran"),
    Route("interpreter", "POST", "/contexts/{id}/restart", (Op.RESTART_CONTEXT,), "same id, language and cwd"),
    Route("interpreter", "GET", "/health", (), "200, no operation"),
    # ---- any other port: a server inside the sandbox (get_host)
    Route(
        "port",
        "*",
        "/{path}",
        (Op.INFO, Op.PORTS_CONNECT),
        "one HTTP request or a WebSocket relayed; the sandbox's access token or its tenant's key required",
    ),
)


def find(plane: str, method: str, path: str) -> Route | None:
    """The table's route of a call (``path`` as the table spells it, ``{id}`` for parameters)."""
    for r in ROUTES:
        if (r.plane, r.method, r.path) == (plane, method, path):
            return r
    return None


def markdown() -> str:
    """The table as docs/e2b.md shows it."""
    lines = ["| plane | E2B call | warmbox operations | notes |", "|---|---|---|---|"]
    for r in ROUTES:
        ops = ", ".join(f"`{o.value}`" for o in r.ops) or "—"
        note = f"**not supported**: {r.unsupported}" if r.unsupported else r.note
        lines.append(f"| {r.plane} | `{r.method} {r.path}` | {ops} | {note} |")
    return "\n".join(lines) + "\n"


__all__ = ["ROUTES", "Route", "find", "markdown"]

if __name__ == "__main__":  # docs/e2b.md's table: python -m warmbox.server.e2b.table
    print(markdown(), end="")
