"""``warmbox node join|ls|drain`` and ``warmbox cluster head|token|cert``: a home as a cluster node,
and the cluster's Ray head, peer token and certificates."""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

from warmbox.cli.context import MODULE_COMMANDS
from warmbox.errors import InvalidArgument


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help=MODULE_COMMANDS["node"])
    nsub = p.add_subparsers(dest="node_command", required=True, parser_class=parser_class)
    q = nsub.add_parser("join", help="run this home's engine as a node of the cluster at HEAD until SIGTERM")
    q.add_argument("head", nargs="?", default="", help="the Ray head's HOST:PORT (default [cluster] ray)")
    q.add_argument("--name", default="", help="the node's name (default [cluster] node)")
    q.add_argument(
        "--slots", type=int, default=0, help="sandboxes it offers (default [cluster] slots, else from memory)"
    )
    q.add_argument("--host", default=None, help="its API's TCP address (default [server] host)")
    q.add_argument("--port", type=int, default=0, help="its API's TCP port (default 0: any free; the registry has it)")
    q.add_argument("--socket", default=None, help="its API's unix socket ('-' for none)")
    q = nsub.add_parser("ls", help="the cluster's nodes as the registry has them")
    q.add_argument("--json", action="store_true")
    q = nsub.add_parser("drain", help="move a node's sandboxes to other nodes, then take it out (through the router)")
    q.add_argument("name")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p = sub.add_parser("cluster", help=MODULE_COMMANDS["cluster"])
    csub = p.add_subparsers(dest="cluster_command", required=True, parser_class=parser_class)
    q = csub.add_parser("head", help="run a Ray head (the cluster's membership) until SIGTERM; prints its address")
    q.add_argument("--port", type=int, default=0, help="its GCS port (default 0: any free)")
    q.add_argument("--temp-dir", default=None, help="Ray's temp dir (short; default /tmp/wbray-head-<port>)")
    q.add_argument(
        "--token-file", default=None, help="the cluster's token, Ray's auth too (default [cluster] token_file)"
    )
    q = csub.add_parser("token", help="make the peer token file (0600) the router and nodes share")
    q.add_argument("file", nargs="?", default=None, help="default [cluster] token_file")
    q = csub.add_parser(
        "cert",
        help="issue a node's (or the router's) certificate from the cluster CA (run where ca.key is; copy the "
        "files to that member)",
    )
    who = q.add_mutually_exclusive_group(required=True)
    who.add_argument("node", nargs="?", default=None, help="the node's name (its files: node-NAME.crt/.key)")
    who.add_argument("--router", action="store_true", help="the router's (router.crt/.key)")
    q.add_argument("--ip", action="append", default=[], help="an address others dial it at (its API's host; repeat)")
    q.add_argument("--dns", action="append", default=[], help="a DNS name others dial it by (repeat)")
    q.add_argument(
        "--tls-dir", default=None, help="the CA's directory (default [cluster] tls_dir, else the token file's)"
    )


async def command(args: argparse.Namespace) -> int:
    if args.command == "cluster":
        if args.cluster_command == "cert":
            return _cert(args)
        return await (_head(args) if args.cluster_command == "head" else _token(args))
    if args.node_command == "join":
        from warmbox.cluster import node
        from warmbox.paths import default_home

        if args.slots < 0:
            raise InvalidArgument(f"--slots must be >= 0, got {args.slots}")
        opts = node.NodeOptions(
            head=args.head, name=args.name, slots=args.slots, host=args.host, port=args.port, socket=args.socket
        )
        return await node.join(default_home(), opts)
    if args.node_command == "ls":
        return _ls(args)
    return await _drain(args)


def _ls(args: argparse.Namespace) -> int:
    import dataclasses

    from warmbox.engine.engine import Engine

    nodes = Engine.for_home().registry.nodes.nodes()
    if args.json:
        print(json.dumps([dataclasses.asdict(n) for n in nodes], indent=2))
        return 0
    now = time.time()
    head = ("NAME", "STATE", "EPOCH", "SLOTS", "LIVE", "POOLED", "BEAT", "TIERS")
    print("{:<16} {:<9} {:>5} {:>5} {:>5} {:>6} {:>6}  {:<24} ADDRESS".format(*head))
    for n in nodes:
        beat = f"{now - n.heartbeat_at:.0f}s" if n.heartbeat_at else "-"
        print(
            f"{n.name:<16} {n.state:<9} {n.epoch:>5} {n.slots:>5} {n.live:>5} {n.pooled:>6} {beat:>6}  "
            f"{','.join(n.tiers):<24} {n.address}"
        )
    return 0


async def _drain(args: argparse.Namespace) -> int:
    """Through the router (--api-url / WARMBOX_API_URL, an admin key): on one host's engine the
    operation answers NotACluster."""
    from warmbox import operations as ops
    from warmbox.sdk.http import HttpTransport, default_url
    from warmbox.sdk.transport import LocalTransport

    t: HttpTransport | LocalTransport = HttpTransport() if default_url() else LocalTransport()
    try:
        report = await t.handle(ops.NodeDrain(args.name, timeout=args.timeout))
    finally:
        await t.close()
    print(f"node {report.node}: {report.state}; moved {len(report.moved)}, left paused {len(report.paused)}")
    for sid in report.moved:
        print(f"  moved {sid}")
    for why in report.failed:
        print(f"  NOT moved {why}")
    return 0 if not report.failed else 1


async def _head(args: argparse.Namespace) -> int:
    import asyncio  # the parser (warmbox --help) runs no loop

    from warmbox import config
    from warmbox.cluster import membership, tls
    from warmbox.errors import ConfigError
    from warmbox.paths import default_home
    from warmbox.server import peer

    settings = config.load(default_home())
    token_file = args.token_file or settings.cluster.token_file
    if not token_file:
        raise ConfigError(
            "the head needs the cluster's token (Ray's authentication): --token-file FILE or [cluster] token_file"
        )
    peer.ensure_token(token_file)
    # the cluster's CA beside the token (made at the first start), and the head's own certificate
    tls_dir = tls.directory(settings.cluster.tls_dir, token_file)
    made = not (tls_dir / tls.CA_CERT).exists()
    member = tls.head_member(tls_dir, tls.local_ips())
    if made:
        print(f"cluster CA made in {tls_dir} (ca.key stays here: `warmbox cluster cert NODE --ip IP` issues members)")
    tmp = Path(args.temp_dir) if args.temp_dir else Path("/tmp") / f"wbray-head-{args.port or 'any'}"
    # on the main thread (not to_thread): the head's PR_SET_PDEATHSIG follows the starting thread
    head = membership.start_head(tmp, port=args.port, token_file=token_file, tls=member)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"ray head at {head.address} (temp dir {tmp}); stop the nodes before it", flush=True)
        while not stop.is_set() and head.alive():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    finally:
        head.stop()
    return 0 if stop.is_set() else 1


async def _token(args: argparse.Namespace) -> int:
    from warmbox import config
    from warmbox.errors import ConfigError
    from warmbox.paths import default_home
    from warmbox.server import peer

    path = args.file or config.load(default_home()).cluster.token_file
    if not path:
        raise ConfigError("give the token file: warmbox cluster token FILE (or set [cluster] token_file)")
    existed = Path(path).exists()
    peer.ensure_token(path)
    print(f"{path}: {'kept (it exists)' if existed else 'made (0600)'}")
    return 0


def _cert(args: argparse.Namespace) -> int:
    """A member's certificate and key (0600) from the CA in the cluster's TLS directory."""
    from warmbox import config
    from warmbox.cluster import tls
    from warmbox.paths import default_home

    cluster = config.load(default_home()).cluster
    tls_dir = Path(args.tls_dir).absolute() if args.tls_dir else tls.directory(cluster.tls_dir, cluster.token_file)
    if not (tls_dir / tls.CA_KEY).exists():
        raise InvalidArgument(
            f"no cluster CA key in {tls_dir}: run this where `warmbox cluster head` made it (or give --tls-dir)"
        )
    name = tls.ROUTER if args.router else tls.node_member(args.node)
    m = tls.issue(tls_dir, name, tuple(args.ip), tuple(args.dns))
    print(f"{m.cert} and {m.key} (0600), signed by {m.ca}: copy the three to that member's [cluster] tls_dir")
    return 0
