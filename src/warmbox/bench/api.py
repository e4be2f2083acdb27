"""``warmbox bench api`` — what the HTTP API costs over the in-process engine, measured in one run.

warm:   create from a warm pool -> first ``run_code("print(2+2)")``, through a ``warmbox serve``
        (the SDK's HTTP transport, as ``AsyncSandbox.create(api_url=...)`` makes it) and in
        process, alternating per iteration; p50/p99 and the ms HTTP adds at p50. Twice: as two
        calls (create, then run_code) and as one (``create(run_code=...)``: one request).
exec:   ``commands.run("true")`` round trip on one sandbox reached both ways (created in process,
        connected over HTTP); ``get_info()`` beside it: a request that never reaches the sandbox,
        i.e. what HTTP alone costs.
files:  a 10 MiB ``files.write`` / ``files.read(format="bytes")`` on that sandbox, both ways: MiB/s.
burst:  N ``create(run_code=...)`` from P client processes over HTTP (each N/P, C in flight)
        against ONE in-process client doing the same N with C in flight; the pool is refilled to
        its size before each side. Creates/s over the whole burst, p50/p99 per create+first run,
        and how many of them were pool hits (on a 2-core host the refill is the limit).

The server is a subprocess on the benchmark's private home, reached over its unix socket (root:
admin without a key) or, with ``--tcp``, over 127.0.0.1 with an admin key the benchmark creates
(``warmbox keys create``). Every sandbox is killed, the server stopped by its pid and the home
removed at the end. Results: a table, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from warmbox.bench.common import _pct, _stats, check_ranges
from warmbox.bench.home import _wait_quiet
from warmbox.errors import InvalidArgument, WarmboxError

POOL = "bench-api"
WARM_POOL_TARGET = 2  # parts warm/exec/files; resized to the burst's pool size for the burst
CODE = "print(2+2)"
SIDES = ("http", "in_process")
GOAL_WARM_ADDED_MS = 1.0  # issue 36's goals
GOAL_EXEC_ADDED_MS = 0.5
GOAL_BURST_RATIO = 1.0
SERVER_START_S = 60.0


def pool_config(refill_concurrency: int) -> dict[str, dict[str, Any]]:
    return {
        POOL: {
            "template": "base",
            "min": WARM_POOL_TARGET,
            "max": WARM_POOL_TARGET,
            "target": WARM_POOL_TARGET,
            "idle_shrink": 3600,  # a long pool fill is no idleness
            "refill_concurrency": refill_concurrency,
        }
    }


# ---------------------------------------------------------------------------- the server


class Server:
    """``warmbox serve`` on the benchmark's home, as a subprocess; stopped by its pid."""

    def __init__(self, home: Path, tcp: bool, loop: str = "asyncio") -> None:
        self.home = home
        self.tcp = tcp
        self.loop = loop
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.key: str | None = None
        self.log = home / "serve.log"

    def start(self) -> None:
        env = {**os.environ, "WARMBOX_HOME": str(self.home)}
        for k in ("WARMBOX_API_URL", "WARMBOX_API_KEY"):  # the server is an engine, never a client
            env.pop(k, None)
        sock = self.home / "api.sock"
        argv = [
            sys.executable,
            "-m",
            "warmbox.cli.main",
            "serve",
            "--socket",
            str(sock),
            "--no-mcp",
            "--loop",
            self.loop,
        ]
        argv += ["--port", "0"] if self.tcp else ["--host", ""]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = _readline(self.proc.stdout, SERVER_START_S)
        m = re.match(r"listening on (.*)", line.decode(errors="replace").strip())
        if m is None:
            raise WarmboxError(f"warmbox serve did not start: {self.tail()}")
        addresses = m.group(1).split(" and ")
        if self.tcp:
            self.url = next(a for a in addresses if a.startswith("http"))
            self.key = self._admin_key(env)
        else:
            self.url = next(a for a in addresses if a.startswith("unix:"))

    def _admin_key(self, env: dict[str, str]) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "warmbox.cli.main", "keys", "create", "--tenant", "bench", "--admin", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise WarmboxError(f"--tcp needs `warmbox keys create`: {out.stderr.strip()[-300:]}")
        try:
            return str(json.loads(out.stdout)["secret"])
        except (ValueError, KeyError, TypeError):
            raise WarmboxError(f"`warmbox keys create --json` printed no secret: {out.stdout[:200]!r}") from None

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process used so far."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace").strip()[-500:] or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def _readline(stream: Any, timeout: float) -> bytes:
    """One line of a child's pipe, waiting at most ``timeout`` seconds (b"" on timeout or EOF)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return buf
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                return buf
            buf += chunk
    finally:
        sel.close()
    return buf


# ---------------------------------------------------------------------------- one client


def _where(url: str | None, key: str | None, home: Path | None) -> dict[str, Any]:
    return {"api_url": url, "api_key": key} if url else {"home": home}


async def _warm_once(where: dict[str, Any], one_request: bool = False) -> tuple[float, bool]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    if one_request:
        sb = await AsyncSandbox.create(tier="container", timeout=120, template="base", run_code=CODE, **where)
    else:
        sb = await AsyncSandbox.create(tier="container", timeout=120, template="base", **where)
    try:
        ex = sb.first_execution if one_request else await sb.run_code(CODE)
        ms = (time.perf_counter() - t0) * 1e3
        assert ex is not None
        if ex.error or ex.stdout.strip() != "4":
            raise WarmboxError(f"warm sandbox answered {ex.stdout!r} {ex.error}")
    finally:
        try:
            await sb.kill()
        finally:
            await sb.close()
    return ms, sb.from_pool


async def burst_client(
    where: dict[str, Any], n: int, concurrency: int, report: Callable[[dict[str, Any]], Awaitable[None]] | None = None
) -> dict[str, Any]:
    """``n`` creates + first run_code, ``concurrency`` in flight; then ``report`` (awaited: a client
    process waits there until every client is done, so no kill overlaps another's creates), then
    kills them."""
    from warmbox.sdk.sandbox import AsyncSandbox

    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    hits = 0
    errors: list[str] = []
    made: list[AsyncSandbox] = []

    async def one() -> None:
        nonlocal hits
        async with gate:
            t0 = time.perf_counter()
            try:
                sb = await AsyncSandbox.create(tier="container", timeout=300, template="base", run_code=CODE, **where)
            except WarmboxError as e:
                errors.append(f"create: {e}")
                return
            made.append(sb)
            ex = sb.first_execution
            if ex is None or ex.stdout.strip() != "4":
                errors.append(f"answered {ex!r}")
                return
            lat.append((time.perf_counter() - t0) * 1e3)
            hits += sb.from_pool

    cpu0 = _own_cpu_s()
    start = time.monotonic()
    await asyncio.gather(*(one() for _ in range(n)))
    end = time.monotonic()
    out = {
        "latencies_ms": lat,
        "hits": hits,
        "errors": errors,
        "start": start,
        "end": end,
        "cpu_s": _own_cpu_s() - cpu0,
    }
    if report is not None:
        await report(out)
    kill_gate = asyncio.Semaphore(concurrency)

    async def kill(sb: AsyncSandbox) -> None:
        async with kill_gate:
            try:
                await sb.kill()
            except WarmboxError as e:
                errors.append(f"kill: {e}")
            finally:
                await sb.close()

    await asyncio.gather(*(kill(sb) for sb in made))
    return out


def _own_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _client_main(argv: list[str]) -> int:
    """A burst client process: ``URL N CONCURRENCY``; the key in WARMBOX_API_KEY. Prints ``ready``
    and waits for a line on stdin; runs; prints its result as one JSON line and waits for another
    line before it kills its sandboxes; prints ``done``."""
    from warmbox.sdk.sandbox import AsyncSandbox  # noqa: F401 - imported before "ready": not timed

    url, n, conc = argv[0], int(argv[1]), int(argv[2])
    key = os.environ.get("WARMBOX_API_KEY") or None
    print("ready", flush=True)
    sys.stdin.readline()
    said = False

    async def report(out: dict[str, Any]) -> None:
        nonlocal said
        said = True
        print(json.dumps(out), flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    try:
        asyncio.run(burst_client(_where(url, key, None), n, conc, report))
    except Exception as e:  # the parent reports it; it cleans up the home whatever happened
        if not said:
            print(json.dumps({"latencies_ms": [], "hits": 0, "errors": [f"{type(e).__name__}: {e}"]}), flush=True)
    print("done", flush=True)
    return 0


async def _remote_burst(server: Server, clients: int, creates: int, concurrency: int) -> dict[str, Any]:
    env = {**os.environ}
    env.pop("WARMBOX_API_KEY", None)
    if server.key:
        env["WARMBOX_API_KEY"] = server.key
    shares = [creates // clients + (i < creates % clients) for i in range(clients)]
    procs = []
    try:
        for share in shares:
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "warmbox.bench.api",
                    server.url,
                    str(share),
                    str(concurrency),
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
        for p in procs:  # every client has imported the SDK before the clock starts
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            if line.strip() != b"ready":
                raise WarmboxError(f"a burst client did not start: {line[:200]!r}")
        cpu0 = server.cpu_s()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        results = []
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 900)
            try:
                results.append(json.loads(line))
            except ValueError:
                raise WarmboxError(f"a burst client died: {line[:200]!r}") from None
        server_cpu = server.cpu_s() - cpu0
        for p in procs:  # every client is done: now they kill their sandboxes
            assert p.stdin is not None
            p.stdin.write(b"kill\n")
            await p.stdin.drain()
        for p in procs:
            await asyncio.wait_for(p.wait(), 300)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    lat = [ms for r in results for ms in r["latencies_ms"]]
    errors = [e for r in results for e in r["errors"]]
    started = [r["start"] for r in results if r.get("start")]
    ended = [r["end"] for r in results if r.get("end")]
    wall = max(ended) - min(started) if started and ended else 0.0
    return {
        "latencies_ms": lat,
        "hits": sum(r["hits"] for r in results),
        "errors": errors,
        "wall_s": wall,
        "clients_cpu_s": sum(r.get("cpu_s", 0.0) for r in results),
        "server_cpu_s": server_cpu,
    }


# ---------------------------------------------------------------------------- the parts


def _order(i: int) -> tuple[str, ...]:
    return SIDES if i % 2 == 0 else SIDES[::-1]


def _pair(samples: dict[str, list[float]]) -> dict[str, Any]:
    stats = {s: _stats(v) for s, v in samples.items()}
    return {
        "stats": stats,
        "added_p50_ms": stats["http"]["p50_ms"] - stats["in_process"]["p50_ms"],
        "added_p99_ms": stats["http"]["p99_ms"] - stats["in_process"]["p99_ms"],
        "ratio_p50": stats["http"]["p50_ms"] / stats["in_process"]["p50_ms"],
    }


async def part_warm(home: Path, server: Server, runs: int) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    wheres = {"http": _where(server.url, server.key, None), "in_process": _where(None, None, home)}
    out: dict[str, Any] = {}
    for one_request in (False, True):
        for side in SIDES:  # one untimed round each: imports, first connection, page cache
            await _wait_quiet(engine, POOL)
            await _warm_once(wheres[side], one_request)
        samples: dict[str, list[float]] = {s: [] for s in SIDES}
        misses = dict.fromkeys(SIDES, 0)
        cpu0 = server.cpu_s()
        for i in range(runs):
            for side in _order(i):
                await _wait_quiet(engine, POOL)  # a refill never competes with a timed create
                ms, hit = await _warm_once(wheres[side], one_request)
                samples[side].append(ms)
                misses[side] += not hit
        got = _pair(samples)
        got.update(runs=runs, pool_misses=misses, server_cpu_ms_per_http_create=(server.cpu_s() - cpu0) * 1e3 / runs)
        out["one_request" if one_request else "two_requests"] = got
    return out


async def part_exec_files(home: Path, server: Server, runs: int, file_mib: int, file_runs: int) -> dict[str, Any]:
    from warmbox.sdk.sandbox import AsyncSandbox

    # made through the server: with --tcp it is the key's tenant's, which the host's in-process
    # front sees too (a sandbox made in process would be no tenant's: unknown to the key)
    remote = await AsyncSandbox.create(
        tier="container", timeout=600, template="base", api_url=server.url, api_key=server.key
    )
    local = None
    try:
        local = await AsyncSandbox.connect(remote.sandbox_id, home=home)
        sbs = {"http": remote, "in_process": local}
        for sb in sbs.values():  # untimed: the connections and the agent's first exec
            for _ in range(5):
                await sb.commands.run("true")
                await sb.get_info()
        exec_s: dict[str, list[float]] = {s: [] for s in SIDES}
        info_s: dict[str, list[float]] = {s: [] for s in SIDES}
        cpu0 = server.cpu_s()
        for i in range(runs):
            for side in _order(i):
                t0 = time.perf_counter()
                r = await sbs[side].commands.run("true")
                exec_s[side].append((time.perf_counter() - t0) * 1e3)
                if r.exit_code != 0:
                    raise WarmboxError(f"`true` exited {r.exit_code}: {r.stderr[-200:]}")
        exec_cpu = (server.cpu_s() - cpu0) * 1e3 / runs
        cpu0 = server.cpu_s()
        for i in range(runs):
            for side in _order(i):
                t0 = time.perf_counter()
                await sbs[side].get_info()
                info_s[side].append((time.perf_counter() - t0) * 1e3)
        info_cpu = (server.cpu_s() - cpu0) * 1e3 / runs
        data = os.urandom(file_mib << 20)
        up: dict[str, list[float]] = {s: [] for s in SIDES}
        down: dict[str, list[float]] = {s: [] for s in SIDES}
        for i in range(file_runs):
            for side in _order(i):
                path = f"/workspace/bench-{side}.bin"
                t0 = time.perf_counter()
                await sbs[side].files.write(path, data)
                up[side].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                back = await sbs[side].files.read(path, format="bytes", max_bytes=len(data) + 1)
                down[side].append((time.perf_counter() - t0) * 1e3)
                if back != data:
                    raise WarmboxError(f"{side}: the file read back differs from the one written")
    finally:
        try:
            await remote.kill()
        finally:
            await remote.close()
            if local is not None:
                await local.close()
    mib = file_mib

    def rates(v: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        # MiB/s at the median time, and at the p99 (slowest) time
        return {
            s: {"p50_mib_s": mib / (statistics.median(x) / 1e3), "p99_mib_s": mib / (_pct(x, 0.99) / 1e3)}
            for s, x in v.items()
        }

    ex = _pair(exec_s)
    ex.update(runs=runs, server_cpu_ms_per_http_exec=exec_cpu)
    info = _pair(info_s)
    info.update(runs=runs, server_cpu_ms_per_http_info=info_cpu)
    return {
        "exec": ex,
        "info": info,
        "files": {
            "mib": mib,
            "runs": file_runs,
            "upload": {"stats": {s: _stats(v) for s, v in up.items()}, "rates": rates(up)},
            "download": {"stats": {s: _stats(v) for s, v in down.items()}, "rates": rates(down)},
        },
    }


async def part_burst(
    home: Path, server: Server, creates: int, clients: int, concurrency: int, pool: int, rounds: int
) -> dict[str, Any]:
    from warmbox.engine import pool as pools
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    fill_s: list[float] = []
    for i in range(rounds):
        for side in _order(i):
            pools.resize(engine, engine.settings(), POOL, pool, min=pool, max=pool)
            t0 = time.monotonic()
            await _wait_quiet(engine, POOL, timeout=900)
            fill_s.append(time.monotonic() - t0)
            if side == "http":
                r = await _remote_burst(server, clients, creates, concurrency)
            else:
                got = await burst_client(_where(None, None, home), creates, concurrency)
                r = {**got, "wall_s": got["end"] - got["start"], "clients_cpu_s": got["cpu_s"], "server_cpu_s": 0.0}
            if r["errors"]:
                raise WarmboxError(f"{len(r['errors'])} of {creates} {side} burst creates failed: {r['errors'][0]}")
            runs[side].append(r)
    pools.resize(engine, engine.settings(), POOL, 0, min=0, max=0)
    out: dict[str, Any] = {
        "creates": creates,
        "clients": clients,
        "concurrency_per_client": concurrency,
        "pool": pool,
        "rounds": rounds,
        "pool_fill_s": fill_s,
    }
    for side in SIDES:
        rs = runs[side]
        lat = [ms for r in rs for ms in r["latencies_ms"]]
        wall = sum(r["wall_s"] for r in rs)
        out[side] = {
            "in_flight": concurrency * (clients if side == "http" else 1),
            "processes": clients if side == "http" else 1,
            "creates_per_s": len(lat) / wall if wall > 0 else 0.0,
            "stats": _stats(lat),
            "pool_hits": sum(r["hits"] for r in rs),
            "cold": len(lat) - sum(r["hits"] for r in rs),
            "wall_s": wall,
            # CPU of the client process(es) and of the server during the burst (kills excluded);
            # in process, the client's CPU is the engine's too
            "clients_cpu_ms_per_create": sum(r["clients_cpu_s"] for r in rs) * 1e3 / max(1, len(lat)),
            "server_cpu_ms_per_create": sum(r["server_cpu_s"] for r in rs) * 1e3 / max(1, len(lat)),
        }
    out["ratio_creates_per_s"] = out["http"]["creates_per_s"] / out["in_process"]["creates_per_s"]
    return out


# ---------------------------------------------------------------------------- entry


def validate(args: argparse.Namespace) -> None:
    check_ranges(
        args,
        (
            ("runs", 1, 10000),
            ("execs", 1, 100000),
            ("file_mb", 1, 256),
            ("file_runs", 1, 1000),
            ("creates", 1, 1000),
            ("clients", 1, 32),
            ("concurrency", 1, 256),
            ("rounds", 1, 100),
            ("refill_concurrency", 1, 64),
        ),
    )
    if args.pool is not None and not 0 <= args.pool <= 1000:
        raise InvalidArgument(f"--pool must be in [0, 1000], got {args.pool}")
    if args.clients > args.creates:
        raise InvalidArgument(f"--clients ({args.clients}) must not exceed --creates ({args.creates})")


async def bench_api(home: Path, args: argparse.Namespace) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    t_start = time.monotonic()
    engine = Engine.for_home(home)
    engine.ensure_daemon()
    await _wait_quiet(engine, POOL)
    server = Server(home, args.tcp, getattr(args, "server_loop", "asyncio"))
    try:
        server.start()
        report: dict[str, Any] = {
            "bench": "api",
            "transport": "tcp" if args.tcp else "unix",
            "server_loop": server.loop,
            "url": server.url,
            "server_pid": server.proc.pid if server.proc else 0,
            "warm": await part_warm(home, server, args.runs),
        }
        report.update(await part_exec_files(home, server, args.execs, args.file_mb, args.file_runs))
        pool = args.creates if args.pool is None else args.pool
        report["burst"] = await part_burst(
            home, server, args.creates, args.clients, args.concurrency, pool, args.rounds
        )
        if server.proc is not None and server.proc.poll() is not None:
            raise WarmboxError(f"warmbox serve exited during the benchmark: {server.tail()}")
    finally:
        server.stop()
    b = report["burst"]
    report["goals"] = {
        f"warm_create_run_code_one_request_added_p50_ms<={GOAL_WARM_ADDED_MS:g}": _goal(
            report["warm"]["one_request"]["added_p50_ms"],
            report["warm"]["one_request"]["added_p50_ms"] <= GOAL_WARM_ADDED_MS,
        ),
        f"exec_added_p50_ms<={GOAL_EXEC_ADDED_MS:g}": _goal(
            report["exec"]["added_p50_ms"], report["exec"]["added_p50_ms"] <= GOAL_EXEC_ADDED_MS
        ),
        f"burst_{b['clients']}_processes/in_process_creates_per_s>={GOAL_BURST_RATIO:g}": _goal(
            b["ratio_creates_per_s"], b["ratio_creates_per_s"] >= GOAL_BURST_RATIO
        ),
    }
    report["seconds"] = time.monotonic() - t_start
    return report


def _goal(measured: float, met: bool) -> dict[str, Any]:
    return {"measured": round(measured, 3), "met": met}


def print_report(r: dict[str, Any]) -> None:
    def rows(title: str, part: dict[str, Any], unit: str = "ms") -> None:
        print(title)
        for side, s in part["stats"].items():
            print(
                f"  {side:<11} p50 {s['p50_ms']:8.2f} {unit}   p99 {s['p99_ms']:8.2f} {unit}"
                f"   min {s['min_ms']:8.2f} {unit}   (n={s['n']})"
            )
        print(
            f"  HTTP adds {part['added_p50_ms']:+.2f} ms at p50, {part['added_p99_ms']:+.2f} ms at p99"
            f" (ratio p50 {part['ratio_p50']:.3f}x)"
        )

    print(
        f"bench api: warmbox serve ({r['server_loop']} loop) over {r['transport']} ({r['url']})"
        " vs the engine in process"
    )
    for how, title in (("two_requests", "create, then run_code"), ("one_request", "create(run_code=...)")):
        w = r["warm"][how]
        rows(f"warm create -> first run_code({CODE!r}) as {title}, {w['runs']} interleaved runs each", w)
        print(
            f"  pool misses: http {w['pool_misses']['http']}, in process {w['pool_misses']['in_process']};"
            f" server CPU per HTTP create+run_code+kill: {w['server_cpu_ms_per_http_create']:.1f} ms"
        )
    e = r["exec"]
    rows(f"exec round trip commands.run('true'), one sandbox, {e['runs']} interleaved runs each", e)
    print(f"  server CPU per HTTP exec: {e['server_cpu_ms_per_http_exec']:.2f} ms")
    i = r["info"]
    rows("get_info() (never reaches the sandbox: the HTTP cost alone)", i)
    print(f"  server CPU per HTTP get_info: {i['server_cpu_ms_per_http_info']:.2f} ms")
    f = r["files"]
    print(f"files: {f['mib']} MiB, {f['runs']} interleaved runs each (MiB/s at the p50 / p99 time)")
    for op in ("upload", "download"):
        for side, x in f[op]["rates"].items():
            s = f[op]["stats"][side]
            print(
                f"  {op:<8} {side:<11} {x['p50_mib_s']:8.1f} MiB/s (p99 {x['p99_mib_s']:7.1f})"
                f"   p50 {s['p50_ms']:8.1f} ms"
            )
    b = r["burst"]
    print(
        f"burst: {b['creates']} create(run_code=...); HTTP from {b['clients']} processes x"
        f" {b['concurrency_per_client']} in flight vs one in-process client with {b['concurrency_per_client']}"
        f" in flight; pool of {b['pool']} refilled before each side ({b['rounds']} round(s))"
    )
    for side in SIDES:
        x = b[side]
        s = x["stats"]
        print(
            f"  {side:<11} {x['creates_per_s']:7.1f} creates/s   p50 {s['p50_ms']:8.1f} ms   p99 {s['p99_ms']:8.1f} ms"
            f"   pool hits {x['pool_hits']}/{s['n']} (cold {x['cold']})"
        )
        print(
            f"  {'':<11} CPU per create: client process(es) {x['clients_cpu_ms_per_create']:.2f} ms,"
            f" server {x['server_cpu_ms_per_create']:.2f} ms"
        )
    print(f"  ratio creates/s http / in process: {b['ratio_creates_per_s']:.2f}x")
    print("  pool fill before each side, s: " + ", ".join(f"{x:.1f}" for x in b["pool_fill_s"]))
    for k, g in r["goals"].items():
        print(f"goal {k}: {g['measured']} -> {'met' if g['met'] else 'NOT met'}")
    print(f"({r['seconds']:.0f} s in all)")


if __name__ == "__main__":
    sys.exit(_client_main(sys.argv[1:]))
