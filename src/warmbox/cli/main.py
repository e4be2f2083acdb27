"""The ``warmbox`` command line. Every error is one line on stderr and exit status 125.

warmbox run [opts] [--] CMD...    create, run, destroy; exits with the command's status
warmbox create [opts]             print the id of a new sandbox that outlives this process
warmbox exec ID [opts] [--] CMD   run in an existing sandbox (a piped stdin is forwarded; -it: a terminal)
warmbox shell ID [opts] [-- CMD]  an interactive terminal in a sandbox (bash unless CMD; -u root where offered)
warmbox ls|ps [-a] [--timings]    list sandboxes (--metadata K=V, --state paused: only those)
warmbox kill ID... | --all        destroy sandboxes
warmbox logs [-f] ID              runtime logs, background processes' output (-f: follow it)
warmbox metrics ID                cpu-s, memory GiB-s, wall/busy/idle seconds of a sandbox
warmbox export ID [-o FILE]       its transcript: timings, transitions, commands, egress, snapshots, cost
warmbox snapshot ID | pause ID    save files + code-context state (pause also releases the sandbox)
warmbox resume ID|SNAP            a paused sandbox running again (same id), or a fork of a snapshot
warmbox snapshots [ls|rm SNAP|gc] list, delete, collect unreferenced artifact blobs
warmbox pool ls                   warm pools: target, ready, hits/misses, warm-up cost
warmbox pool resize NAME [N]      set a pool's target (and --min/--max); --wait to watch it fill
warmbox pool warm [NAME...]       wait (with progress) until pools reach their targets
warmbox down                      stop this home's daemon; pooled sandboxes are destroyed
warmbox volume create NAME --size 1G | ls | show NAME | rm NAME   named volumes (run/create -v NAME:PATH[:ro])
warmbox keys create|ls|revoke|budget  API keys of tenants (secret shown once), their quotas and daily budgets
warmbox approvals ls|approve ID|deny ID   the approval queue (starts over budget, large creates, network asks)
warmbox template build FILE|NAME  build a template (Dockerfile, .py, .toml, or a NAME); progress per step
warmbox template ls|show|rm       built templates: versions, image ids, sizes; remove one
warmbox template gc [--dry-run]   remove layers and microVM roots nothing uses; bytes freed (admin)
warmbox config                    the effective settings (warmbox.toml + WARMBOX_* overrides)
warmbox doctor                    which tiers this host can run, and why not
warmbox advise [--language L --untrusted|--trusted --io compute|syscall-heavy|network --guest-kernel]
                                  which tier for such code here, why, and why not the others
warmbox demo                      a short tour on the embedded defaults
warmbox mcp                       an MCP server on stdin/stdout (sandbox tools for an agent)
warmbox bench start|burst|exec|density|api|session|e2b|cluster|template|profile|cli   benchmarks vs raw runtimes
warmbox serve [--host H --port P]  the HTTP API (/v1) on 127.0.0.1:7420 and a unix socket (+ MCP at /mcp)
warmbox serve --cluster HEAD      the same API as a cluster's API tier: each call runs on its sandbox's node
warmbox node join HEAD [--name N --slots K]   this home's engine as a cluster node (Ray head HEAD) until SIGTERM
warmbox node ls | drain NAME      the cluster's nodes; move a node's sandboxes off it (through the router)
warmbox cluster head | token [FILE]   run a Ray head for a cluster; make the peer token file

--api-url URL (or WARMBOX_API_URL) sends every command to a warmbox server instead of the
in-process engine, with --api-key KEY (or WARMBOX_API_KEY).

Imports are part of the design here (issue 38): asyncio, the SDK, the HTTP client and the engine
are imported by the commands that use them, when they run. The parser builds only the command
asked for (each command is listed, name and help, without its module), and the operations and
records are loaded on first use; ``warmbox --help`` loads none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from warmbox.cli import context
from warmbox.errors import WarmboxError
from warmbox.lazy import lazy_module

TYPE_CHECKING = False  # typing costs --help ~2 ms; mypy reads any TYPE_CHECKING as True (annotations are strings)
if TYPE_CHECKING:
    import dataclasses
    from typing import Any, NoReturn

    from warmbox import operations as ops
    from warmbox.cli.thin import Transport
    from warmbox.models import Lifecycle, Limits
else:  # run on first use: neither --help nor a parse error loads them
    ops = lazy_module("warmbox.operations")
    dataclasses = lazy_module("dataclasses")

EXIT_ERROR = 125


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}  # the top parser's, by name

    def error(self, message: str) -> NoReturn:  # one line, our exit status, no usage dump
        print(f"warmbox: error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def _env_pairs(values: list[str] | None) -> dict[str, str]:
    return context.pairs(values, "--env", "NAME")


def _add_sandbox_opts(p: argparse.ArgumentParser) -> None:
    if not isinstance(p, argparse.ArgumentParser):
        return  # another command's parser is built, not this one's (context.Subcommands)
    from warmbox.models import Limits

    p.add_argument(
        "--tier",
        default=None,
        help="isolation tier, or auto: the one warmbox advise picks for untrusted Python (default: warmbox.toml's, "
        "else container)",
    )
    p.add_argument("--timeout", type=float, default=None, help="sandbox lifetime, seconds (default 300)")
    p.add_argument("--template", default=None, help="base, pydata, shell or one from warmbox.toml")
    p.add_argument("--no-pool", action="store_true", help="always create cold, never from a warm pool")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="environment variable")
    p.add_argument("--memory", type=int, default=Limits.memory_mb, metavar="MB", help="memory limit, MiB")
    p.add_argument("--cpus", type=float, default=Limits.cpus, help="CPU quota in cores")
    p.add_argument("--pids", type=int, default=Limits.pids, help="process/thread limit")
    p.add_argument("--disk", type=int, default=Limits.disk_mb, metavar="MB", help="size of /workspace, MiB")
    _add_network_opts(p)
    p.add_argument(
        "--secret",
        action="append",
        metavar="NAME=HOST[,HOST]",
        help="pass host env var NAME as a brokered secret: the sandbox sees a placeholder, "
        "the proxy sends the value to HOST only",
    )
    p.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="a label (get_info, ls --metadata)")
    p.add_argument(
        "--on-timeout", choices=("kill", "pause"), default="kill", help="at the timeout: destroy (default) or pause"
    )
    p.add_argument("--idle-pause", type=float, default=None, metavar="S", help="pause after S seconds without use")
    p.add_argument("--auto-resume", action="store_true", help="the next use of a paused sandbox resumes it")
    p.add_argument(
        "-v",
        "--volume",
        action="append",
        metavar="NAME:PATH[:ro]",
        help="mount a named volume (warmbox volume create) at PATH (repeatable)",
    )
    _add_requirement_opts(p)  # any of them: --tier auto


def _add_requirement_opts(p: argparse.ArgumentParser, advise: bool = False) -> None:
    """The four questions: ``advise`` asks them (defaults: untrusted Python, compute); on run/create
    any of them makes the tier "auto" (the others take those defaults)."""
    p.add_argument(
        "--language",
        default="python" if advise else None,
        help="python, javascript (js, node), bash (sh), c or wasm (default python)",
    )
    trust = p.add_mutually_exclusive_group()
    trust.add_argument(
        "--untrusted", dest="trusted", action="store_false", help="code from the public, multi-tenant (default)"
    )
    trust.add_argument("--trusted", dest="trusted", action="store_true", help="your own developers' agents")
    p.set_defaults(trusted=False if advise else None)
    p.add_argument(
        "--io",
        default="compute" if advise else None,
        choices=("compute", "syscall-heavy", "network"),
        help="compute (CPU loops), syscall-heavy (fork, files: builds, installs) or network (default compute)",
    )
    p.add_argument(
        "--guest-kernel", action="store_true", default=False if advise else None, help="a dedicated guest kernel"
    )


def _requirements(args: argparse.Namespace) -> Any:
    """The four questions as given on the command line (None on run/create when none was)."""
    from warmbox.models import Requirements

    given = (args.language, args.trusted, args.io, args.guest_kernel)
    if all(v is None for v in given):
        return None
    return Requirements(
        language=args.language or "python",
        trusted=bool(args.trusted),
        io=args.io or "compute",
        guest_kernel=bool(args.guest_kernel),
    )


def _add_network_opts(p: argparse.ArgumentParser) -> None:
    if not isinstance(p, argparse.ArgumentParser):
        return  # another command's parser is built, not this one's (context.Subcommands)
    from warmbox.network.policy import PRESETS

    p.add_argument(
        "--network",
        choices=("none", "internet"),
        default=None,
        help="egress: none (default; loopback only) or internet (public addresses only)",
    )
    p.add_argument(
        "--allow",
        action="append",
        metavar="HOST|*.DOMAIN|CIDR|PRESET",
        help="allow egress to (repeatable); a preset names a registry's hosts: " + ", ".join(PRESETS),
    )
    p.add_argument(
        "--deny", action="append", metavar="HOST|*.DOMAIN|CIDR|PRESET", help="deny egress to (wins over allow)"
    )


def _network(args: argparse.Namespace) -> Any:
    from warmbox import Network

    if args.allow or args.deny:
        if args.network == "internet":
            raise WarmboxError("--network internet cannot be combined with --allow/--deny")
        return Network(allow=args.allow or [], deny=args.deny or [])
    return args.network or "none"


def _secrets(args: argparse.Namespace) -> dict[str, Any]:
    from warmbox import Secret

    out = {}
    for item in getattr(args, "secret", None) or []:
        name, sep, hosts = item.partition("=")
        if not sep or not hosts:
            raise WarmboxError(f"--secret takes NAME=HOST[,HOST], got {item!r}")
        value = os.environ.get(name)
        if not value:
            raise WarmboxError(f"--secret {name}: the host environment has no variable {name} to take it from")
        out[name] = Secret(value, hosts=[h for h in hosts.split(",") if h])
    return out


def _resume_secrets(items: list[str] | None) -> dict[str, Any] | None:
    """--secret NAME (its recorded hosts) or NAME=HOST[,HOST] of resume, values from the host env."""
    from warmbox import Secret

    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        name, sep, hosts = item.partition("=")
        value = os.environ.get(name)
        if not value:
            raise WarmboxError(f"--secret {name}: the host environment has no variable {name} to take it from")
        out[name] = Secret(value, hosts=[h for h in hosts.split(",") if h]) if sep else value
    return out


def _add_exec_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON record instead of the output")
    p.add_argument("--cmd-timeout", type=float, default=60.0, metavar="S", help="command timeout, seconds (0: none)")
    p.add_argument("--cwd", default=None, help="working directory inside the sandbox")
    p.add_argument("cmd", nargs="*", help="the command and its arguments (after -- if one starts with -)")


_KEY_HELP = "a repeat with the same KEY runs nothing again: it gets the first"
MAX_KEYED_STDIN = 16 << 20  # a keyed command's piped stdin, sent whole (the server's JSON bound)


def _parser(argv: list[str] | None = None) -> _Parser:
    """The command line's parser: every command, or (``argv`` given) every command listed but only
    the one ``argv`` names built (``warmbox --help`` builds none, and imports no command's module)."""
    ap = _Parser(prog="warmbox", description="Sandboxes for untrusted code.")
    ap.add_argument("--api-url", default=None, help="a warmbox server (http(s)://host:port or unix:/path)")
    ap.add_argument("--api-key", default=None, help="its API key (default: WARMBOX_API_KEY)")
    only = None
    if argv is not None:
        i = context.option_words(ap, argv, 0)
        only = argv[i] if i is not None and i < len(argv) else ""
    sub = context.Subcommands(ap.add_subparsers(dest="command", required=True, parser_class=_Parser), only)
    p = sub.add_parser("serve", help="the HTTP API: 127.0.0.1:7420 and a unix socket ([server] in warmbox.toml)")
    p.add_argument("--host", default=None, help="TCP address (default [server] host, 127.0.0.1); '' for none")
    p.add_argument("--port", type=int, default=None, help="TCP port (default [server] port, 7420; 0: any free)")
    p.add_argument("--socket", default=None, help="unix socket path ('-' for none)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (required off loopback)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--no-mcp", action="store_true", help="do not serve MCP at /mcp")
    p.add_argument(
        "--cluster",
        default="",
        metavar="HEAD",
        help="serve as a cluster's API tier: HEAD is the Ray head (HOST:PORT); [cluster] gives the registry and token",
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default=None, help="json: one JSON object per log line (request ids)"
    )
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the event loop (uvloop: pip it)")
    p = sub.add_parser("run", help="run one command in a fresh sandbox")
    _add_sandbox_opts(p)
    _add_exec_opts(p)
    p = sub.add_parser("create", help="create a sandbox and print its id")
    _add_sandbox_opts(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--idempotency-key", default=None, metavar="KEY", help=_KEY_HELP + " create's sandbox")
    p = sub.add_parser("exec", help="run a command in an existing sandbox (a piped stdin is forwarded)")
    p.add_argument("sandbox_id")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="environment variable of the command")
    p.add_argument("-u", "--user", choices=("user", "root"), default="user", help="root: where the tier offers it")
    p.add_argument(
        "-i", "--interactive", action="store_true", help="forward stdin even from a terminal (a pipe always is)"
    )
    p.add_argument("-t", "--tty", action="store_true", help="a terminal in the sandbox, as warmbox shell (-it)")
    p.add_argument(
        "--idempotency-key", default=None, metavar="KEY", help=_KEY_HELP + " command's result (stdin sent whole)"
    )
    _add_exec_opts(p)
    p = sub.add_parser("shell", help="an interactive terminal in an existing sandbox")
    p.add_argument("sandbox_id")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="environment variable")
    p.add_argument("--cwd", default=None, help="working directory inside the sandbox")
    p.add_argument("-u", "--user", choices=("user", "root"), default="user", help="root: where the tier offers it")
    p.add_argument("cmd", nargs="*", help="a command instead of bash (after -- if it starts with -)")
    p = sub.add_parser("port-forward", help="reach a port of a sandbox from this host until interrupted")
    p.add_argument("sandbox_id")
    p.add_argument("port", type=int, help="the TCP port inside the sandbox")
    p.add_argument("--unix", action="store_true", help="a unix socket (in a 0700 directory) instead of 127.0.0.1:N")
    p.add_argument("--check", action="store_true", help="first wait (30 s at most) until something listens")
    for name, help_ in (("ls", "list sandboxes"), ("ps", "list sandboxes (as ls)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("-a", "--all", action="store_true", help="include destroyed sandboxes")
        p.add_argument("--timings", action="store_true", help="show stage timings")
        p.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="only sandboxes with this label")
        p.add_argument("--state", action="append", metavar="STATE", help="only sandboxes in this state (e.g. paused)")
        p.add_argument("--json", action="store_true")
    p = sub.add_parser("kill", help="destroy sandboxes")
    p.add_argument("sandbox_ids", nargs="*")
    p.add_argument("--all", action="store_true", help="every sandbox you have, running or paused")
    p = sub.add_parser("metrics", help="cost of a sandbox so far (or final)")
    p.add_argument("sandbox_id")
    p.add_argument("--json", action="store_true")
    p.add_argument("--history", action="store_true", help="its readings instead (every 5 s, the last hour)")
    for name, help_ in (
        ("snapshot", "snapshot a sandbox (it keeps running)"),
        ("pause", "snapshot a sandbox and release it"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("sandbox_id")
        p.add_argument("--json", action="store_true")
    p = sub.add_parser("resume", help="a paused sandbox running again (same id), or a new one forked from a snapshot")
    p.add_argument("ref", help="snap-… or the paused sandbox's sb-…")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="environment variable")
    p.add_argument(
        "--secret",
        action="append",
        metavar="NAME[=HOST[,HOST]]",
        help="the value of a secret it had, from the host env var NAME (never stored); its hosts "
        "as recorded unless given (repeatable)",
    )
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("snapshots", help="list / delete snapshots, collect garbage")
    p.add_argument("action", nargs="?", choices=["ls", "rm", "gc"], default="ls")
    p.add_argument("snapshot_ids", nargs="*")
    p.add_argument("--now", action="store_true", help="gc: no grace period for young blobs")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("pool", help="warm pools")
    psub = p.add_subparsers(dest="pool_command", required=True, parser_class=_Parser)
    q = psub.add_parser("ls", help="list pools")
    q.add_argument("--json", action="store_true")
    q = psub.add_parser("resize", help="set a pool's target size and bounds")
    q.add_argument("name")
    q.add_argument("target", type=int, nargs="?")
    q.add_argument("--min", type=int, default=None)
    q.add_argument("--max", type=int, default=None)
    q.add_argument("--wait", action="store_true", help="show progress until the pool reaches its target")
    q.add_argument("--wait-timeout", type=float, default=600.0, metavar="S")
    q = psub.add_parser("warm", help="wait until pools reach their targets")
    q.add_argument("names", nargs="*")
    q.add_argument("--wait-timeout", type=float, default=600.0, metavar="S")
    p = sub.add_parser("net", help="a sandbox's egress: audit log and policy")
    nsub = p.add_subparsers(dest="net_command", required=True, parser_class=_Parser)
    q = nsub.add_parser("log", help="every egress attempt of a sandbox")
    q.add_argument("sandbox_id")
    q.add_argument("--json", action="store_true")
    q = nsub.add_parser("set", help="replace a running sandbox's policy (applies to new connections)")
    q.add_argument("sandbox_id")
    _add_network_opts(q)
    q = nsub.add_parser("show", help="a sandbox's policy")
    q.add_argument("sandbox_id")
    sub.add_parser("down", help="stop the daemon; destroys pooled (not claimed) sandboxes")
    # the commands of their own modules, each imported only when its command is built
    if sub.wants("keys"):
        from warmbox.cli import keys

        keys.add_parser(sub, _Parser)
    else:
        sub.listed("keys")
    if sub.wants("approvals"):
        from warmbox.cli import approvals

        approvals.add_parser(sub, _Parser)
    else:
        sub.listed("approvals")
    if sub.wants("volume"):
        from warmbox.cli import volumes

        volumes.add_parser(sub, _Parser)
    else:
        sub.listed("volume")
    if sub.wants("db"):
        from warmbox.cli import db

        db.add_parser(sub, _Parser)
    else:
        sub.listed("db")
    if sub.wants("template"):
        from warmbox.cli import templates

        templates.add_parser(sub, _Parser)
    else:
        sub.listed("template")
    if sub.wants("node") or sub.wants("cluster"):
        from warmbox.cli import cluster

        cluster.add_parser(sub, _Parser)
    else:
        sub.listed("node")
        sub.listed("cluster")
    p = sub.add_parser("config", help="show the effective settings")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("doctor", help="which tiers this host can run")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--security",
        action="store_true",
        help="the guarantees warmbox gives against hostile code, each with the test that proves it",
    )
    p = sub.add_parser("advise", help="which tier for your code (the four questions), and why")
    _add_requirement_opts(p, advise=True)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser(
        "export",
        help="a sandbox's transcript (also once it ended): one typed record per line, for an audit or a replay",
    )
    p.add_argument("sandbox_id")
    p.add_argument("-o", "--output", metavar="FILE", help="write it there (default: standard output)")
    p.add_argument("--format", choices=["ndjson", "json"], default="ndjson", help="NDJSON lines or one JSON array")
    p = sub.add_parser(
        "logs", help="a sandbox's runtime logs (kept after it ended) and its background processes' output"
    )
    p.add_argument("sandbox_id")
    p.add_argument("-f", "--follow", action="store_true", help="then follow the processes' output until they end")
    sub.add_parser("demo", help="a short tour")
    sub.add_parser("mcp", help="serve the sandbox tools over MCP on stdin/stdout (for an agent's MCP client)")
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    b = bsub.add_parser("start", help="create->first command: warm pool, cold, raw runc, raw bwrap")
    b.add_argument("--runs", type=int, default=None, help="default 20 (microvm: 5, isolate: 200)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--variant", choices=["empty", "agent", "both"], default="both")
    b.add_argument(
        "--tier",
        choices=["container", "microvm", "isolate"],
        default="container",
        help="microvm: restore and cold boot vs raw QEMU (default --runs 5); isolate: warm/cold isolate -> "
        "first snippet, runs/s, idle isolate memory vs raw isolated-vm (default --runs 200)",
    )
    b = bsub.add_parser("burst", help="N concurrent creates against a pool of N and a smaller pool")
    b.add_argument("--burst", type=int, default=50)
    b.add_argument("--pools", type=int, nargs="+", default=[50, 10], metavar="SIZE")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("exec", help="commands/s for `true` and empty-request round trip")
    b.add_argument("--seconds", type=float, default=3.0)
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("snapshot", help="snapshot/pause time, artifact size, resume->first command")
    b.add_argument("--runs", type=int, default=5)
    b.add_argument("--mb", type=int, default=20, help="MiB of random data in /workspace (container tier)")
    b.add_argument("--tier", choices=["container", "gvisor", "microvm"], default="container")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("density", help="idle warm sandboxes and memory per sandbox")
    b.add_argument("--max", type=int, default=100, help="stop at this many sandboxes")
    b.add_argument("--step", type=int, default=10)
    b.add_argument("--memory-bound-gib", type=float, default=4.0, help="stop when they use this much")
    b.add_argument("--template", default="base")
    b.add_argument(
        "--claims", type=int, default=10, help="then this many creates from the full pool: first run_code / command"
    )
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("template", help="custom template: cold build, cached rebuild, start and pool claim vs base")
    b.add_argument(
        "--runs", type=int, default=10, help="interleaved create->first command samples per template and way"
    )
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser(
        "cli", help="whole-process warmbox --help, run (pool), exec vs podman run --rm, interleaved (p50)"
    )
    b.add_argument("--runs", type=int, default=20, help="interleaved rounds (default 20)")
    b.add_argument("--bridge", action="store_true", help="podman's default network too (it leaves a CNI bridge)")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser(
        "profile", help="per tier: a CPU loop and syscall loops (fork, files, socket) vs the host; cached for advise"
    )
    b.add_argument("--tier", action="append", metavar="TIER", help="only this tier (repeatable; default: every one)")
    b.add_argument("--budget", type=float, default=0.5, help="seconds per loop and place (default 0.5)")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("e2b", help="E2B's official SDK vs warmbox's own over HTTP: warm create, exec")
    b.add_argument("--runs", type=int, default=20, help="warm create->first run_code samples per SDK")
    b.add_argument("--execs", type=int, default=50, help='commands.run("true") round trips per SDK')
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser("api", help="warmbox serve (HTTP) vs in process: warm create, exec, files, burst")
    b.add_argument("--runs", type=int, default=20, help="warm create->first run_code samples per side")
    b.add_argument("--execs", type=int, default=300, help="exec (and get_info) round trips per side")
    b.add_argument("--file-mb", type=int, default=10, help="MiB per upload/download")
    b.add_argument("--file-runs", type=int, default=5, help="uploads and downloads per side")
    b.add_argument("--creates", type=int, default=200, help="burst: creates per side")
    b.add_argument("--clients", type=int, default=4, help="burst: HTTP client processes")
    b.add_argument("--concurrency", type=int, default=8, help="burst: creates in flight per client")
    b.add_argument("--pool", type=int, default=None, help="burst: pool size before each side (default --creates)")
    b.add_argument("--server-loop", choices=("asyncio", "uvloop"), default="asyncio", help="serve --loop")
    b.add_argument("--rounds", type=int, default=1, help="burst: rounds per side, alternating")
    b.add_argument("--refill-concurrency", type=int, default=2, help="sandboxes the pool warms at once")
    b.add_argument("--tcp", action="store_true", help="over 127.0.0.1 with an admin key instead of the unix socket")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser(
        "session",
        help="an agent session turn by turn with think time: keep-alive vs recreate vs pause, per tier, vs raw runc",
    )
    b.add_argument("--think", type=float, default=20.0, help="seconds the model thinks between turns (default 20)")
    b.add_argument("--think-scale", type=float, default=1.0, help="multiply --think by this (CI: 0.01)")
    b.add_argument(
        "--tier", action="append", choices=["container", "gvisor", "microvm"], help="repeatable; default: all"
    )
    b.add_argument(
        "--strategy",
        action="append",
        choices=["keep", "recreate", "pause", "autopause"],
        help="repeatable; default: keep, recreate, pause",
    )
    b.add_argument("--session", action="append", choices=["coding", "data"], help="repeatable; default: both")
    b.add_argument("--cpu-hour", type=float, help="price of a CPU-hour (default: warmbox.toml's [cost], else E2B's)")
    b.add_argument("--gib-hour", type=float, help="price of a GiB-hour of memory (default: [cost], else E2B's)")
    b.add_argument("--chart", metavar="STEM", help="write STEM.png and STEM.svg: per-turn latency vs idle cost")
    b.add_argument("--json", action="store_true")
    b = bsub.add_parser(
        "cluster",
        help="a cluster of 1, 2, 3 nodes on this host: warm create, creates/s, failover (router, PostgreSQL, Ray)",
    )
    b.add_argument("--nodes", type=int, default=3, help="measure with 1 .. this many nodes (at most 3)")
    b.add_argument("--runs", type=int, default=20, help="warm create->first run_code samples per step")
    b.add_argument("--creates", type=int, default=24, help="burst: creates per step")
    b.add_argument("--clients", type=int, default=2, help="burst: client processes")
    b.add_argument("--concurrency", type=int, default=4, help="burst: creates in flight per client")
    b.add_argument("--failovers", type=int, default=5, help="node kills (with all nodes up); 0: none")
    b.add_argument("--slots", type=int, default=32, help="sandboxes per node")
    b.add_argument("--pool", type=int, default=0, help="cluster-wide pool target (default: --creates)")
    b.add_argument("--json", action="store_true")
    ap.subcommands.update(sub.done())
    return ap


def _cmd(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise WarmboxError("no command given (warmbox run [OPTIONS] CMD [ARGS...])")
    return cmd


def _limits(args: argparse.Namespace) -> Limits:
    from warmbox.models import Limits

    return Limits(memory_mb=args.memory, cpus=args.cpus, pids=args.pids, disk_mb=args.disk)


def _create_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from warmbox.cli.volumes import parse_mount

    return {
        "timeout": args.timeout,
        "envs": _env_pairs(args.env),
        "limits": _limits(args),
        "template": args.template,
        "pool": not args.no_pool,
        "network": _network(args),
        "secrets": _secrets(args),
        "metadata": context.pairs(args.metadata, "--metadata") or None,
        "lifecycle": _lifecycle(args),
        "volumes": [parse_mount(v) for v in args.volume] if args.volume else None,
        "requirements": _requirements(args),
    }


def _lifecycle(args: argparse.Namespace) -> Lifecycle | None:
    from warmbox.models import Lifecycle

    lc = Lifecycle(on_timeout=args.on_timeout, idle_pause_after=args.idle_pause, auto_resume=args.auto_resume)
    return None if lc == Lifecycle() else lc


def _timings_json(stages: list) -> list[dict]:
    return [dataclasses.asdict(t) for t in stages]


def _timings_text(stages: list) -> str:
    """Stages the caller waited for plain; the ones a pool did beforehand in [brackets]."""
    return " ".join(
        f"{t.stage}={t.duration_ms:.1f}" if t.on_request_path else f"[{t.stage}={t.duration_ms:.1f}]" for t in stages
    )


def _record(result: Any, sb: Any, via: str) -> dict:
    rec = dataclasses.asdict(result)
    rec["sandbox_id"] = sb.sandbox_id
    rec["from_pool"] = sb.from_pool
    rec["timings"] = sb.timings
    rec["stage_timings"] = _timings_json(sb.stage_timings)
    rec["via"] = via
    return rec


def _via(args: argparse.Namespace) -> str:
    """Which engine ran the command, as --json says it: "server" (a running ``warmbox serve`` of
    this home, reached by the thin path), "api" (--api-url / WARMBOX_API_URL) or "in-process"."""
    if getattr(args, "thin", None) is not None:
        return "server"
    return "api" if context.api_url() else "in-process"


def _piped_stdin(interactive: bool = False) -> Any:
    """This process's stdin as chunks when it is a pipe or a file (``echo ... | warmbox exec``);
    None for a terminal (interactive: ``warmbox shell``) or a device such as /dev/null.
    interactive (``exec -i``): a terminal's too, line by line until ^D."""
    import stat

    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or (interactive and os.isatty(0))):
        return None

    def chunks() -> Any:
        while data := os.read(0, 64 << 10):
            yield data

    return chunks()


async def _exec_in(sb: Any, args: argparse.Namespace, cmd: list[str]) -> int:
    key = getattr(args, "idempotency_key", None)
    stdin = _piped_stdin(getattr(args, "interactive", False))
    if key is not None and stdin is not None:  # a keyed command's stdin is part of what a repeat must match
        data = b""
        for chunk in stdin:
            data += chunk
            if len(data) > MAX_KEYED_STDIN:
                raise WarmboxError(f"with --idempotency-key, stdin is sent whole: at most {MAX_KEYED_STDIN} bytes")
        stdin = data
    result = await sb.commands.run(
        cmd,
        envs=_env_pairs(getattr(args, "env", None)) if args.command == "exec" else None,
        user=getattr(args, "user", "user"),
        stdin=stdin,
        cwd=args.cwd,
        timeout=args.cmd_timeout or None,
        idempotency_key=key,
        **_sinks(args),
    )
    return _print_result(args, result, sb)


def _print_result(args: argparse.Namespace, result: Any, sb: Any) -> int:
    if args.json:
        print(json.dumps(_record(result, sb, _via(args))))
    else:
        for flag in ("timed_out", "truncated", "oom_killed"):
            if getattr(result, flag):
                print(f"warmbox: {flag.replace('_', ' ')}", file=sys.stderr)
    return int(result.exit_code)


def _sinks(args: argparse.Namespace) -> dict[str, Any]:
    if args.json:
        return {}
    return {
        "on_stdout": lambda s: (sys.stdout.write(s), sys.stdout.flush()),
        "on_stderr": lambda s: (sys.stderr.write(s), sys.stderr.flush()),
    }


class _Started:
    """What --json tells of a sandbox the thin path created or connected to (AsyncSandbox's names).
    (A plain class: a dataclass here would load dataclasses for every ``warmbox --help``.)"""

    def __init__(self, sandbox_id: str, from_pool: bool, stage_timings: list[Any]) -> None:
        self.sandbox_id = sandbox_id
        self.from_pool = from_pool
        self.stage_timings = stage_timings

    @property
    def timings(self) -> dict[str, float]:
        return {t.stage: t.duration_ms for t in self.stage_timings}


async def _thin_command(args: argparse.Namespace) -> int:
    """run and exec on the thin path: the requests AsyncSandbox makes for them (create, or connect;
    the command; its first-command timing once; for run, the kill), on a running server."""
    from warmbox.models import StageTiming

    t = args.thin
    cmd = _cmd(args)
    if args.command == "run":
        kw = _create_kwargs(args)
        kw["volumes"] = tuple(kw["volumes"]) if kw["volumes"] else None
        opened = await t.handle(ops.Create(tier=args.tier, **kw))
    else:
        opened = await t.handle(ops.Connect(args.sandbox_id))
    sb = _Started(opened.info.sandbox_id, opened.info.from_pool, list(opened.timings))
    try:
        started = time.perf_counter()
        envs = _env_pairs(args.env) if args.command == "exec" else None
        request = ops.Exec(
            sb.sandbox_id,
            cmd,
            envs=envs,
            cwd=args.cwd,
            timeout=args.cmd_timeout or None,
            idempotency_key=getattr(args, "idempotency_key", None),
            **_sinks(args),
        )
        result = await t.handle(request)
        if not any(x.stage == "first_command" for x in sb.stage_timings):
            ms = (time.perf_counter() - started) * 1e3
            sb.stage_timings.append(StageTiming(sb.sandbox_id, "first_command", ms, True))
            await t.handle(ops.RecordFirstCommand(sb.sandbox_id, ms))
    finally:
        if args.command == "run":
            await t.handle(ops.Kill(sb.sandbox_id))
    return _print_result(args, result, sb)


async def _run(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    cmd = _cmd(args)
    async with await AsyncSandbox.create(tier=args.tier, **_create_kwargs(args)) as sb:
        return await _exec_in(sb, args, cmd)


async def _create(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    sb = await AsyncSandbox.create(tier=args.tier, idempotency_key=args.idempotency_key, **_create_kwargs(args))
    await sb.close()
    if args.json:
        print(
            json.dumps(
                {
                    "sandbox_id": sb.sandbox_id,
                    "tier": sb.tier,
                    "template": sb.template,
                    "from_pool": sb.from_pool,
                    "timings": sb.timings,
                    "stage_timings": _timings_json(sb.stage_timings),
                }
            )
        )
    else:
        print(sb.sandbox_id)
    return 0


async def _exec(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    if args.tty:  # docker's exec -it: a terminal, as warmbox shell
        if args.json:
            raise WarmboxError("--json and -t do not go together: a terminal's output is a screen")
        return await _shell(args)
    cmd = _cmd(args)
    sb = await AsyncSandbox.connect(args.sandbox_id)
    try:
        return await _exec_in(sb, args, cmd)
    finally:
        await sb.close()


async def _shell(args: argparse.Namespace) -> int:
    """The terminal of this process in raw mode, attached to a PTY in the sandbox: keys go in as
    they are typed, the screen comes back, a resize of the window (SIGWINCH) resizes the PTY.
    The terminal is restored however it ends."""
    import asyncio
    import signal
    import termios
    import tty

    from warmbox.sdk.sandbox import AsyncSandbox

    if not os.isatty(0) or not os.isatty(1):
        what = "exec -t" if args.command == "exec" else "warmbox shell"
        raise WarmboxError(f"{what} needs a terminal (for pipes: warmbox exec ID CMD, without -t)")
    cmd = list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd) or None
    size = os.get_terminal_size(1)
    loop = asyncio.get_running_loop()
    sb = await AsyncSandbox.connect(args.sandbox_id)
    saved = termios.tcgetattr(0)
    keys: asyncio.Queue[bytes] = asyncio.Queue()
    resized = asyncio.Event()
    try:
        term = await sb.pty.create(
            size.columns,
            size.lines,
            cmd=cmd,
            envs=_env_pairs(args.env),
            cwd=args.cwd,
            user=args.user,
            on_data=lambda data: os.write(1, data),
        )
        tty.setraw(0)
        loop.add_reader(0, lambda: keys.put_nowait(os.read(0, 4096)))
        loop.add_signal_handler(signal.SIGWINCH, resized.set)

        async def typing() -> None:  # one SendStdin at a time: keys arrive in order
            while True:
                data = await keys.get()
                while not keys.empty():
                    data += keys.get_nowait()
                if not data:
                    return  # our stdin closed
                await term.send_input(data)

        async def resizing() -> None:
            while True:
                await resized.wait()
                resized.clear()
                now = os.get_terminal_size(1)
                await term.resize(now.columns, now.lines)

        helpers = [asyncio.ensure_future(typing()), asyncio.ensure_future(resizing())]
        try:
            done, _ = await asyncio.wait([asyncio.ensure_future(term.wait()), *helpers], return_when="FIRST_COMPLETED")
            for t in done:
                t.result()  # a failure of the connection or of input: its typed error
            result = await term.wait()
        finally:
            for t in helpers:
                t.cancel()
        return result.exit_code
    finally:
        loop.remove_reader(0)
        loop.remove_signal_handler(signal.SIGWINCH)
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        await sb.close()


async def _serve(args: argparse.Namespace) -> int:
    from warmbox.config import load
    from warmbox.paths import default_home
    from warmbox.server.serve import serve

    home = default_home()
    settings = load(home).server
    changes: dict[str, Any] = {}
    for flag, field in (("host", "host"), ("port", "port"), ("socket", "socket"), ("log_format", "log_format")):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise WarmboxError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None:
        changes.update(tls_cert=args.tls_cert, tls_key=args.tls_key)
    fronts = None
    if args.cluster:
        from warmbox.cluster.api import cluster_fronts

        def fronts(engine: Any) -> Any:
            return cluster_fronts(engine, args.cluster)

    await serve(home, dataclasses.replace(settings, **changes), mcp=not args.no_mcp, fronts=fronts)
    return 0


def _warn_config() -> None:
    """A broken warmbox.toml said on stderr (a command that does not need the settings still runs)."""
    from warmbox.config import load
    from warmbox.errors import ConfigError
    from warmbox.paths import default_home

    if context.api_url():  # the server's settings count, not this host's file
        return
    try:
        load(default_home())
    except ConfigError as e:
        print(
            f"warmbox: warning: {e} (the listing does not need it; commands that start sandboxes fail)", file=sys.stderr
        )


async def _ls(args: argparse.Namespace) -> int:
    from warmbox.models import SandboxQuery, State, validate_query

    _warn_config()
    t = getattr(args, "thin", None) or context.transport()
    query = None
    if args.metadata or args.state:
        query = validate_query(
            SandboxQuery(
                metadata=context.pairs(args.metadata, "--metadata") or None,
                state=tuple(args.state) if args.state else None,  # type: ignore[arg-type]  # checked here
            )
        )
    infos = await t.handle(ops.ListSandboxes(include_dead=args.all, reap=True, query=query))
    timings = (
        {i.sandbox_id: await t.handle(ops.Timings(i.sandbox_id)) for i in infos} if args.json or args.timings else {}
    )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **dataclasses.asdict(i),
                        "state": i.state.value,
                        "from_pool": i.from_pool,
                        "timings": {x.stage: x.duration_ms for x in timings[i.sandbox_id]},
                        "stage_timings": _timings_json(timings[i.sandbox_id]),
                        "via": _via(args),
                    }
                    for i in infos
                ]
            )
        )
        return 0
    now = time.time()
    header = (
        f"{'ID':<16} {'TIER':<10} {'TEMPLATE':<9} {'STATE':<10} {'POOL':<8} {'AGE':>7} {'EXPIRES':>8} "
        f"{'MEM':>6} {'CPUS':>5}"
    )
    if args.timings:
        header += "  TIMINGS ms ([done by the pool before the request])"
    print(header)
    for i in infos:
        # a paused sandbox has no deadline running (a resume gives it its timeout again), an ended one none at all
        ticking = i.state in (State.CREATING, State.READY, State.RUNNING)
        expires = f"{max(0, i.expires_at - now):>7.0f}s" if ticking else f"{'-':>8}"
        line = (
            f"{i.sandbox_id:<16} {i.tier:<10} {i.template:<9} {i.state.value:<10} {i.pool or '-':<8} "
            f"{now - i.created_at:>6.0f}s {expires} {i.memory_mb:>5}M {i.cpus:>5.2f}"
        )
        if args.timings:
            line += "  " + _timings_text(timings[i.sandbox_id])
        print(line)
    return 0


async def _port_forward(args: argparse.Namespace) -> int:
    """Print the forward's address (one line), then relay until SIGINT/SIGTERM or the sandbox ends;
    the sandbox is let go of, never ended."""
    import asyncio
    import signal

    from warmbox.sdk.sandbox import AsyncSandbox

    sb = await AsyncSandbox.connect(args.sandbox_id)
    try:
        if args.check:
            print(
                f"warmbox: waiting (30 s at most) for a server to listen on port {args.port} in {args.sandbox_id}",
                file=sys.stderr,
                flush=True,
            )
        host = await sb.get_host(args.port, unix=args.unix, check=args.check, timeout=30.0)
        print(host, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except TimeoutError:
                if not await sb.is_running():  # ended (or paused): the forward goes with it
                    print(f"warmbox: sandbox {args.sandbox_id} is no longer running", file=sys.stderr)
                    return EXIT_ERROR
        return 0
    finally:
        await sb.close()


async def _metrics(args: argparse.Namespace) -> int:
    if args.history:
        got = await context.transport().handle(ops.MetricsHistory(args.sandbox_id))
        lines = [f"{s.timestamp:.0f} cpu {s.cpu_used_pct:.1f}% memory {s.memory_bytes / 2**20:.1f} MiB" for s in got]
        print(json.dumps([dataclasses.asdict(s) for s in got]) if args.json else "\n".join(lines))
        return 0
    m = await context.transport().handle(ops.Metrics(args.sandbox_id))
    if args.json:
        print(json.dumps(dataclasses.asdict(m)))
    else:
        print(
            f"{m.sandbox_id}{' (final)' if m.final else ''}: cpu {m.cpu_s:.3f} s, memory {m.memory_gib_s:.4f} GiB-s "
            f"(now {m.memory_bytes / 2**20:.1f} MiB, peak {m.memory_peak_bytes / 2**20:.1f} MiB), "
            f"wall {m.wall_s:.1f} s, "
            f"busy {m.busy_s:.1f} s, idle {m.idle_s:.1f} s, {m.commands} commands"
        )
    return 0


async def _snapshot(args: argparse.Namespace) -> int:
    op = ops.Pause if args.command == "pause" else ops.Snapshot
    m = await context.transport().handle(op(args.sandbox_id))
    if args.json:
        print(json.dumps(dataclasses.asdict(m)))
    else:
        print(m.snapshot_id)
        print(
            f"  {m.files_raw_bytes} bytes of files -> {m.files_bytes} stored; memory: {m.memory}; "
            f"context saved: {m.context_saved}"
            + (f" (skipped: {', '.join(m.context_skipped)})" if m.context_skipped else ""),
            file=sys.stderr,
        )
    return 0


async def _resume(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    sb = await AsyncSandbox.resume(
        args.ref, timeout=args.timeout, envs=_env_pairs(args.env), secrets=_resume_secrets(args.secret)
    )
    info = await sb.get_info()
    await sb.close()
    if args.json:
        print(json.dumps({"sandbox_id": sb.sandbox_id, "from_snapshot": info.parent_snapshot, "timings": sb.timings}))
    else:
        print(sb.sandbox_id)
    return 0


async def _snapshots(args: argparse.Namespace) -> int:
    t = context.transport()
    if args.action == "rm":
        if not args.snapshot_ids:
            raise WarmboxError("snapshots rm needs snapshot ids")
        for sid in args.snapshot_ids:
            await t.handle(ops.DeleteSnapshot(sid))
            print(f"{sid} deleted")
        return 0
    if args.action == "gc":
        report = await t.handle(ops.GcSnapshots(now=args.now))
        print(f"{report.removed} unreferenced blobs deleted from {report.store}")
        for sid in report.broken:
            print(f"  unreadable manifest (cannot be restored; `warmbox snapshots rm {sid}`): {sid}")
        return 0
    rows = await t.handle(ops.ListSnapshots())
    if args.json:
        print(
            json.dumps([{"snapshot_id": a, "sandbox_id": b, "created_at": c, "size_bytes": d} for a, b, c, d in rows])
        )
        return 0
    print(f"{'SNAPSHOT':<28} {'SANDBOX':<16} {'AGE':>7} {'SIZE':>10}")
    now = time.time()
    for a, b, c, d in rows:
        print(f"{a:<28} {b:<16} {now - c:>6.0f}s {d:>10}")
    return 0


async def _pool(args: argparse.Namespace) -> int:
    from warmbox.cli import pools

    return await pools.command(args)


async def _volume(args: argparse.Namespace) -> int:
    from warmbox.cli import volumes

    return await volumes.command(args)


async def _db(args: argparse.Namespace) -> int:
    from warmbox.cli import db

    return await db.command(args)


async def _down(args: argparse.Namespace) -> int:
    from warmbox.cli import pools

    return await pools.down()


async def _approvals(args: argparse.Namespace) -> int:
    from warmbox.cli import approvals

    return await approvals.command(args, context.transport())


async def _cluster(args: argparse.Namespace) -> int:
    from warmbox.cli import cluster

    return await cluster.command(args)


async def _keys(args: argparse.Namespace) -> int:
    from warmbox.cli import keys

    return await keys.command(args)


async def _template(args: argparse.Namespace) -> int:
    from warmbox.cli import templates

    return await templates.command(args)


async def _config(args: argparse.Namespace) -> int:
    from warmbox.cli import pools

    return pools.show_config(args.json)


async def _kill(args: argparse.Namespace) -> int:
    t = getattr(args, "thin", None) or context.transport()
    if args.all == bool(args.sandbox_ids):
        raise WarmboxError("warmbox kill takes sandbox ids, or --all (every sandbox you have, running or paused)")
    ids = args.sandbox_ids
    if args.all:
        ids = [i.sandbox_id for i in await t.handle(ops.ListSandboxes(reap=True))]
        if not ids:
            print("no sandboxes to destroy")
    status = 0
    for sid in ids:
        try:
            if await t.handle(ops.Kill(sid)):
                print(f"{sid} destroyed")
            else:
                print(f"{sid} was already destroyed")
        except WarmboxError as e:
            print(f"warmbox: error: {e}", file=sys.stderr)
            status = EXIT_ERROR
    return status


async def _export(args: argparse.Namespace) -> int:
    from warmbox import transcript

    got = await context.transport().handle(ops.Export(args.sandbox_id))
    data = transcript.dumps(got, args.format)
    if args.output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        try:
            with open(args.output, "wb") as f:
                f.write(data)
        except OSError as e:
            raise WarmboxError(f"cannot write {args.output}: {e.strerror or e}") from None
        n = len(got.commands)
        print(f"{args.output}: {n} command{'s' * (n != 1)}, {len(got.snapshots)} snapshots", file=sys.stderr)
    return 0


LOGS_QUIET_S = 0.5  # logs without -f: a process's output is taken until it is this long quiet


async def _logs(args: argparse.Namespace) -> int:
    """The runtime logs, then what each running background process printed (its kept output; a
    foreground command's output went to its caller); -f: then follow them until they end."""
    import asyncio

    from warmbox.models import State

    t = context.transport()
    sid = args.sandbox_id
    text = await t.handle(ops.Logs(sid))
    info = await t.handle(ops.Info(sid))
    procs = []
    if info.state in (State.READY, State.RUNNING):  # never resume a paused one to look
        procs = [p for p in await t.handle(ops.ListProcesses(sid)) if not p.pty]
    if not text and not procs:
        print(f"no runtime logs kept and no background process running in {sid}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    sys.stdout.flush()
    await asyncio.gather(*(_process_output(t, sid, p, args.follow, len(procs) > 1) for p in procs))
    return 0


async def _process_output(t: Any, sid: str, proc: Any, follow: bool, label: bool) -> None:
    """A background process's output to our stdout and stderr (each line led by ``[PID]`` when
    ``label``); until it ends with ``follow``, else until it is LOGS_QUIET_S quiet."""
    import asyncio

    stream = await t.handle(ops.ConnectProcess(sid, proc.pid))
    partial = {"stdout": "", "stderr": ""}

    def write(kind: str, text: str) -> None:
        out = sys.stdout if kind == "stdout" else sys.stderr
        if label:
            lines = (partial[kind] + text).split("\n")
            partial[kind] = lines.pop()
            text = "".join(f"[{proc.pid}] {line}\n" for line in lines)
        out.write(text)
        out.flush()

    try:
        while True:
            try:
                ev = await (stream.next() if follow else asyncio.wait_for(stream.next(), LOGS_QUIET_S))
            except TimeoutError:
                break  # what it printed so far
            if ev is None:
                break
            if ev.kind == "lost":
                print(f"warmbox: {ev.size} bytes of process {proc.pid}'s output were dropped", file=sys.stderr)
            elif ev.kind in partial:
                write(ev.kind, ev.text)
    finally:
        stream.cancel()
    for kind in partial:  # a last line without its newline
        rest, partial[kind] = partial[kind], ""
        if rest:
            write(kind, rest + "\n")


async def _doctor(args: argparse.Namespace) -> int:
    if args.security:
        from warmbox.cli.security import print_guarantees

        return print_guarantees(as_json=args.json)
    rows = await context.transport().handle(ops.Doctor())
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        for r in rows:
            print(f"{r.tier:<10} {'yes' if r.available else 'no':<4} {r.reason}")
        note = _trust_note()
        if note:
            print(note)
    return 0 if any(r.available for r in rows) else 1


def _trust_note() -> str:
    """Does a sandbox trust what the host trusts? ("" when there is nothing to say.) A host-only CA
    is usually a TLS-intercepting upstream's: behind one, every download in a sandbox fails to
    verify without extra_ca."""
    from warmbox.config import load
    from warmbox.errors import ConfigError
    from warmbox.network.tls import host_only_cas
    from warmbox.paths import default_home

    if context.api_url():  # the server's host is another one
        return ""
    try:
        extra = load(default_home()).network.extra_ca
    except ConfigError:
        return ""
    missing = host_only_cas(extra)
    if not missing:
        return f"{'tls':<10} {'yes':<4} sandboxes trust every CA the host does" + (
            f" (extra_ca {extra})" if extra else ""
        )
    shown = "; ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (
        f"{'tls':<10} {'warn':<4} the host trusts {len(missing)} CA(s) that sandboxes do not ({shown}); behind a "
        "TLS-intercepting upstream, pip/npm/curl in a sandbox fail to verify: set [network] extra_ca in "
        "warmbox.toml to a file of those CAs (Debian keeps a host's own in /usr/local/share/ca-certificates)"
    )


async def _advise(args: argparse.Namespace) -> int:
    from warmbox.errors import NoSuitableTier

    req = _requirements(args)
    try:
        choice = await context.transport().handle(ops.ChooseTier(req))
    except NoSuitableTier as e:
        if args.json:
            print(json.dumps({"tier": None, "error": str(e), "rejected": list(e.rejected)}))
        else:
            print("no tier on this host fits: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(req).items()))
            for line in e.rejected:
                print(f"  - {line}")
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(choice)))
        return 0
    print(f"tier: {choice.tier}")
    print("why:")
    for reason in choice.reasons:
        print(f"  + {reason}")
    if choice.rejected:
        print("not:")
        for tier, why in choice.rejected.items():
            print(f"  - {tier}: {why}")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from warmbox.cli.demo import demo

    return await demo()


async def _mcp(args: argparse.Namespace) -> int:
    """An MCP server on stdio over this home's engine; sandboxes it created outlive it (to their timeout)."""
    from warmbox.server.mcp import build_mcp

    transport = context.transport()
    try:
        await build_mcp(lambda ctx: transport).run_stdio_async()
    finally:
        await transport.close()
    return 0


async def _bench(args: argparse.Namespace) -> int:
    from warmbox import bench

    return await bench.command(args)


async def _net(args: argparse.Namespace) -> int:
    t = context.transport()
    if args.net_command == "log":
        rows = await t.handle(ops.NetworkLog(args.sandbox_id))
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows]))
            return 0
        for e in rows:
            at = time.strftime("%H:%M:%S", time.localtime(e.at))
            print(
                f"{at} {e.kind:<7} {e.decision:<5} {e.host}:{e.port} {e.address or '-'} {e.rule}"
                f" up={e.bytes_up} down={e.bytes_down}" + (f" ({e.detail})" if e.detail else "")
            )
        return 0
    if args.net_command == "set":
        print(await t.handle(ops.UpdateNetwork(args.sandbox_id, _network(args))))
        return 0
    print(await t.handle(ops.NetworkPolicy(args.sandbox_id)))
    return 0


_COMMANDS = {
    "serve": _serve,
    "net": _net,
    "run": _run,
    "create": _create,
    "exec": _exec,
    "shell": _shell,
    "port-forward": _port_forward,
    "ls": _ls,
    "ps": _ls,
    "kill": _kill,
    "metrics": _metrics,
    "snapshot": _snapshot,
    "pause": _snapshot,
    "resume": _resume,
    "snapshots": _snapshots,
    "pool": _pool,
    "down": _down,
    "keys": _keys,
    "node": _cluster,
    "cluster": _cluster,
    "approvals": _approvals,
    "config": _config,
    "doctor": _doctor,
    "advise": _advise,
    "template": _template,
    "logs": _logs,
    "export": _export,
    "demo": _demo,
    "mcp": _mcp,
    "bench": _bench,
    "volume": _volume,
    "db": _db,
}


_THIN_COMMANDS = {"run": _thin_command, "exec": _thin_command, "ls": _ls, "ps": _ls, "kill": _kill}


def _thin(args: argparse.Namespace) -> Transport | None:
    """The thin path (cli/thin.py) when the command is one of run, exec, ls, kill, no server is
    named (--api-url), nothing of this process's stdin is to be forwarded and no terminal is
    asked for, and a ``warmbox serve`` of this home answers on its socket; else None: the command
    builds its own client (the engine in process, or the HTTP transport to the named server)."""
    if args.command not in _THIN_COMMANDS or context.api_url():
        return None
    if args.command in ("run", "exec"):
        if getattr(args, "tty", False) or getattr(args, "user", "user") != "user":
            return None
        if _piped_stdin(getattr(args, "interactive", False)) is not None:
            return None
    from warmbox.cli.thin import ThinClient, Transport

    client = ThinClient.open()
    return None if client is None else Transport(client)


_COMMAND_AFTER = {"run": 0, "exec": 1, "shell": 1}  # our positionals before the command's first word


def _separate(ap: _Parser, argv: list[str]) -> list[str]:
    """``warmbox run python3 -c 'print(1)'`` as ``docker run`` reads it: the command starts at the
    first word that is not ours (an option, its value, the sandbox id), and a ``--`` goes there,
    so its own options (``-c``) are never read as ours. argv as it was when a ``--`` is there already."""
    i = context.option_words(ap, argv, 0)
    if i is None or i >= len(argv) or argv[i] not in _COMMAND_AFTER:
        return argv
    sub, ours = ap.subcommands[argv[i]], _COMMAND_AFTER[argv[i]]
    i += 1
    while True:
        found = context.option_words(sub, argv, i)
        if found is None or found >= len(argv) or argv[found] == "--":
            return argv
        if ours == 0:
            return [*argv[:found], "--", *argv[found:]]
        ours, i = ours - 1, found + 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Everything after the first ``--`` is the command, so options may follow the sandbox id
    (``warmbox exec ID --cwd /tmp -e A=1 -- pwd``) and the command's own are never read as ours;
    without a ``--``, the command starts at the first word that is not ours (:func:`_separate`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser(argv)
    argv = _separate(ap, argv)
    if "--" not in argv:
        return ap.parse_args(argv)
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    if not hasattr(args, "cmd") or args.cmd:
        return _parser(argv).parse_args(argv)  # no command here, or one before the --: argparse says why
    args.cmd = argv[cut + 1 :]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)  # --help, or a bad word, ends here: before asyncio is loaded
    if args.api_url is not None:
        os.environ["WARMBOX_API_URL"] = args.api_url
    if args.api_key is not None:
        os.environ["WARMBOX_API_KEY"] = args.api_key
    try:
        args.thin = _thin(args)
        if args.thin is not None:
            try:
                return args.thin.run(_THIN_COMMANDS[args.command](args))
            finally:
                args.thin.client.close()
        import asyncio

        with asyncio.Runner(loop_factory=context.loop_factory(args)) as runner:
            return runner.run(context.closing(_COMMANDS[args.command](args)))
    except WarmboxError as e:
        print(f"warmbox: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("warmbox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (``warmbox ls | head``): stop quietly, as Unix tools do
        try:  # and let the final flush find somewhere to go
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141  # 128 + SIGPIPE, what a shell shows for a writer its pipe ended
    except Exception as e:  # a bug of ours: one line, the traceback only on request
        if os.environ.get("WARMBOX_DEBUG"):
            raise
        print(
            f"warmbox: internal error: {type(e).__name__}: {e} (WARMBOX_DEBUG=1 shows the traceback)", file=sys.stderr
        )
        return EXIT_ERROR


def entry() -> None:
    """The ``warmbox`` command: main(), then exit at once. Everything the CLI owes is done by then
    (registry rows committed, sandboxes handed to the daemon); the interpreter's own teardown of
    a few hundred modules would add 60-100 ms to every command."""
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more to say
        code = code or EXIT_ERROR
    os._exit(code)


if __name__ == "__main__":
    entry()
