"""The ``warmbox`` command line. Every error is one line on stderr and exit status 125.

    warmbox run [opts] -- CMD...      create, run, destroy; exits with the command's status
    warmbox create [opts]             print the id of a new sandbox that outlives this process
    warmbox exec ID [opts] -- CMD...  run in an existing sandbox
    warmbox ls [--all] [--timings]    list sandboxes
    warmbox kill ID...                destroy sandboxes
    warmbox doctor                    which tiers this host can run, and why not
    warmbox demo                      a short tour on the embedded defaults
    warmbox bench start               cold start vs raw runc / bwrap
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

from warmbox.errors import WarmboxError
from warmbox.models import Limits

EXIT_ERROR = 125


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, our exit status, no usage dump
        print(f"warmbox: error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def _env_pairs(values: list[str] | None) -> dict[str, str]:
    out = {}
    for item in values or []:
        if "=" not in item:
            raise WarmboxError(f"--env expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def _add_sandbox_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", default="container", help="isolation tier (default: container)")
    p.add_argument("--timeout", type=float, default=300.0, help="sandbox lifetime, seconds (default 300)")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE", help="environment variable")
    p.add_argument("--memory", type=int, default=Limits.memory_mb, metavar="MB", help="memory limit, MiB")
    p.add_argument("--cpus", type=float, default=Limits.cpus, help="CPU quota in cores")
    p.add_argument("--pids", type=int, default=Limits.pids, help="process/thread limit")


def _add_exec_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON record instead of the output")
    p.add_argument("--cmd-timeout", type=float, default=60.0, metavar="S", help="command timeout, seconds (0: none)")
    p.add_argument("--cwd", default=None, help="working directory inside the sandbox")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command and its arguments")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="warmbox", description="Sandboxes for untrusted code.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("run", help="run one command in a fresh sandbox")
    _add_sandbox_opts(p)
    _add_exec_opts(p)
    p = sub.add_parser("create", help="create a sandbox and print its id")
    _add_sandbox_opts(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("exec", help="run a command in an existing sandbox")
    p.add_argument("sandbox_id")
    _add_exec_opts(p)
    p = sub.add_parser("ls", help="list sandboxes")
    p.add_argument("--all", action="store_true", help="include destroyed sandboxes")
    p.add_argument("--timings", action="store_true", help="show stage timings")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("kill", help="destroy sandboxes")
    p.add_argument("sandbox_ids", nargs="+")
    p = sub.add_parser("doctor", help="which tiers this host can run")
    p.add_argument("--json", action="store_true")
    sub.add_parser("demo", help="a short tour")
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    b = bsub.add_parser("start", help="create->first command vs raw runc and bwrap")
    b.add_argument("--runs", type=int, default=20)
    b.add_argument("--json", action="store_true")
    b.add_argument("--variant", choices=["empty", "agent", "both"], default="both")
    return ap


def _cmd(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise WarmboxError("no command given (put it after --)")
    return cmd


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(memory_mb=args.memory, cpus=args.cpus, pids=args.pids)


def _record(result: Any, sandbox_id: str, timings: dict[str, float]) -> dict:
    rec = dataclasses.asdict(result)
    rec["sandbox_id"] = sandbox_id
    rec["timings"] = timings
    return rec


async def _exec_in(sb: Any, args: argparse.Namespace, cmd: list[str]) -> int:
    stream = not args.json
    result = await sb.commands.run(
        cmd, cwd=args.cwd, timeout=args.cmd_timeout or None,
        on_stdout=(lambda s: (sys.stdout.write(s), sys.stdout.flush())) if stream else None,
        on_stderr=(lambda s: (sys.stderr.write(s), sys.stderr.flush())) if stream else None)
    if args.json:
        print(json.dumps(_record(result, sb.sandbox_id, sb.timings)))
    else:
        for flag in ("timed_out", "truncated", "oom_killed"):
            if getattr(result, flag):
                print(f"warmbox: {flag.replace('_', ' ')}", file=sys.stderr)
    return result.exit_code


async def _run(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    cmd = _cmd(args)
    async with await AsyncSandbox.create(args.tier, timeout=args.timeout, envs=_env_pairs(args.env),
                                         limits=_limits(args)) as sb:
        return await _exec_in(sb, args, cmd)


async def _create(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    sb = await AsyncSandbox.create(args.tier, timeout=args.timeout, envs=_env_pairs(args.env), limits=_limits(args))
    await sb._client.close()
    if args.json:
        print(json.dumps({"sandbox_id": sb.sandbox_id, "tier": sb.tier, "timings": sb.timings}))
    else:
        print(sb.sandbox_id)
    return 0


async def _exec(args: argparse.Namespace) -> int:
    from warmbox.sdk.sandbox import AsyncSandbox

    cmd = _cmd(args)
    sb = await AsyncSandbox.connect(args.sandbox_id)
    try:
        return await _exec_in(sb, args, cmd)
    finally:
        await sb._client.close()


async def _ls(args: argparse.Namespace) -> int:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home()
    await engine.reap()
    infos = engine.list(include_dead=args.all)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(i), "state": i.state.value, "timings": engine.timings(i.sandbox_id)}
                          for i in infos]))
        return 0
    now = time.time()
    header = f"{'ID':<16} {'TIER':<10} {'STATE':<10} {'AGE':>7} {'EXPIRES':>8} {'MEM':>6} {'CPUS':>5}"
    if args.timings:
        header += "  TIMINGS (ms)"
    print(header)
    for i in infos:
        line = (f"{i.sandbox_id:<16} {i.tier:<10} {i.state.value:<10} {now - i.created_at:>6.0f}s "
                f"{max(0, i.expires_at - now):>7.0f}s {i.memory_mb:>5}M {i.cpus:>5.2f}")
        if args.timings:
            line += "  " + " ".join(f"{k}={v:.1f}" for k, v in engine.timings(i.sandbox_id).items())
        print(line)
    return 0


async def _kill(args: argparse.Namespace) -> int:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home()
    status = 0
    for sid in args.sandbox_ids:
        try:
            if await engine.destroy(sid, "killed from the CLI"):
                print(f"{sid} destroyed")
            else:
                print(f"{sid} was already destroyed")
        except WarmboxError as e:
            print(f"warmbox: error: {e}", file=sys.stderr)
            status = EXIT_ERROR
    return status


async def _doctor(args: argparse.Namespace) -> int:
    from warmbox.engine.engine import Engine

    rows = Engine.for_home().doctor()
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        for r in rows:
            print(f"{r.tier:<10} {'yes' if r.available else 'no':<4} {r.reason}")
    return 0 if any(r.available for r in rows) else 1


async def _demo(args: argparse.Namespace) -> int:
    from warmbox.cli.demo import demo

    return await demo()


async def _bench(args: argparse.Namespace) -> int:
    from warmbox.cli.bench import bench_start

    return await bench_start(runs=args.runs, as_json=args.json, variant=args.variant)


_COMMANDS = {"run": _run, "create": _create, "exec": _exec, "ls": _ls, "kill": _kill, "doctor": _doctor,
             "demo": _demo, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_COMMANDS[args.command](args))
    except WarmboxError as e:
        print(f"warmbox: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("warmbox: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
