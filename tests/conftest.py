"""Shared fixtures. Sandbox tests use real runc sandboxes in a private WARMBOX_HOME."""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmbox.engine import teardown

ROOT = Path(__file__).resolve().parent.parent
# No pool is shared by the tests except ``iso``, whose shape (memory_mb = 500) only the pooled
# variant of the ``sb`` fixture asks for; pool tests add their own pools with set_config().
BASE_CONFIG = """
[daemon]
idle_exit = 3

[pools.iso]
template = "base"
min = 1
max = 1
target = 1
limits = { memory_mb = 500 }
"""
POOLED_LIMITS_MB = 500


# ---- the fast lane: `pytest -m "not sandbox"` runs only pure tests, in seconds
# Every test that starts a real sandbox (runc, runsc, QEMU), a network namespace, the daemon or a
# proxy carries the ``sandbox`` marker. A missing mark must fail loudly, not quietly turn the fast
# lane into the whole suite, so two checks:
# 1. At collection, in every lane: a test whose fixtures (directly or through other fixtures) start
#    such things is refused unless marked. Every such fixture depends on ``runc_ready`` (sandboxes,
#    the daemon, the proxy), ``world`` (the test network namespaces) or ``pg_server`` (a real
#    PostgreSQL), so these names suffice.
# 2. At run time, in a session that runs no marked test (the fast lane): an audit hook
#    (sys.addaudithook sees subprocess, posix_spawn and exec from any thread of this process) refuses
#    to start runc, runsc, QEMU, `ip netns`, the daemon or the proxy. This catches a test that calls
#    e.g. Sandbox.create() with no such fixture. It is armed only there because in the full lane a
#    marked test's background teardown may still spawn runc while an unmarked test runs.
SANDBOX_FIXTURES = frozenset({"runc_ready", "world", "pg_server"})
# A test of a real cluster (Ray, PostgreSQL, nodes, the router: tests/cluster, and the --api=cluster
# lane) carries ``cluster`` as well as ``sandbox``: the main suite runs -m "not cluster", the
# cluster lane is its own CI step. Every fixture that starts a cluster depends on ``cluster``.
CLUSTER_FIXTURES = frozenset({"cluster"})


def _sandbox_process(argv: object) -> str | None:
    """What a command line would start that only a ``sandbox`` test may (``sh -c`` strings included)."""
    parts = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
    words = [w for a in parts for w in os.fsdecode(a).split()]
    names = {os.path.basename(w) for w in words}
    if names & {"runc", "runsc"}:
        return "runc/runsc"
    if any(n.startswith("qemu-system") for n in names):
        return "QEMU"
    if "ip" in names and "netns" in words:
        return "a network namespace (ip netns)"
    if any("warmbox.engine.daemon" in w or "warmbox.network.proxy" in w for w in words):
        return "the warmbox daemon or proxy"
    if names & {"raylet", "gcs_server"} or (names & {"ray", "ray.scripts.scripts"} and "start" in words):
        return "Ray"
    if names & {"postgres", "pg_ctl", "initdb", "pg_ctlcluster"}:
        return "PostgreSQL"
    if ("node" in words and "join" in words) or ("serve" in words and "--cluster" in words):
        return "a warmbox cluster node or router"
    return None


class FastLaneGuard:
    """The audit hook of check 2; ``hits`` also fails a test whose code swallowed the refusal."""

    EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec"})  # args: (program, argv, ...)

    def __init__(self) -> None:
        self.hits: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event not in self.EVENTS:
            return
        what = _sandbox_process(args[1])
        if what:
            self.hits.append(f"{what}: {args[1]!r}")
            raise RuntimeError(f"a test not marked @pytest.mark.sandbox started {what} in the fast lane")


FAST_LANE_GUARD = pytest.StashKey[FastLaneGuard]()


# ---- the API lanes: `pytest tests/sdk tests/cli --api=http` runs the SDK and CLI suites against
# a real `warmbox serve` on the session's home (every Sandbox.create()/connect() and every cli(...)
# goes over HTTP through WARMBOX_API_URL). Such a test starts a server with an engine, so it is a
# ``sandbox`` test in that lane. A test that needs the in-process engine (home=, engine internals)
# carries @pytest.mark.in_process(reason) and is skipped there.
# `pytest tests/sdk tests/cli tests/cluster --api=cluster` does the same against the router of a real cluster
# (`warmbox serve --cluster`, tests/cluster/conftest.py) with a tenant key; there a test is also
# ``cluster``, and one that needs the server to run on the session's home (its daemon, its pools,
# its registry) carries @pytest.mark.one_host(reason) and is skipped there.
HTTP_LANE_DIRS = ("tests/sdk/", "tests/cli/")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--api",
        choices=("local", "http", "cluster"),
        default="local",
        help="how tests/sdk and tests/cli reach the engine: in process (local), a real `warmbox serve` (http) "
        "or the router of a real cluster, `warmbox serve --cluster` (cluster)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "in_process(reason): needs the in-process engine; skipped under --api=http|cluster with the reason"
    )
    config.addinivalue_line(
        "markers",
        "one_host(reason): needs its server to run on the session's home (daemon, pools, registry file); "
        "skipped under --api=cluster with the reason",
    )


def api_lane(node: pytest.Item | pytest.Collector) -> str:
    """The --api lane ``node`` runs in over HTTP ("http" or "cluster": tests/sdk, tests/cli), else ""."""
    lane = node.config.getoption("api")
    if lane == "local":
        return ""
    try:
        rel = Path(str(node.path)).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return ""
    return lane if rel.startswith(HTTP_LANE_DIRS) else ""


def over_http(node: pytest.Item | pytest.Collector) -> bool:
    """Whether ``node`` runs against a server over HTTP (--api=http or --api=cluster, tests/sdk or tests/cli)."""
    return bool(api_lane(node))


def over_cluster(node: pytest.Item | pytest.Collector) -> bool:
    """Whether ``node`` runs against the cluster's router (--api=cluster, tests/sdk or tests/cli)."""
    return api_lane(node) == "cluster"


def _skip_marked(item: pytest.Item, mark: str, lane: str, default: str) -> None:
    found = item.get_closest_marker(mark)
    if found is not None:
        reason = found.args[0] if found.args else default
        item.add_marker(pytest.mark.skip(reason=f"--api={lane}: {reason}"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marks must be right in every lane
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        lane = api_lane(item)
        if lane:
            item.add_marker(pytest.mark.sandbox)  # it talks to a server that runs an engine
            _skip_marked(item, "in_process", lane, "needs the in-process engine")
            if "microvm" in item.name:  # a duplicate case: the transport carries every tier alike
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"--api={lane}: the microVM tier (TCG here: the slowest boots) runs in the "
                        "in-process lane; this lane tests the transport, which no tier changes"
                    )
                )
        if lane == "cluster":
            item.add_marker(pytest.mark.cluster)
            _skip_marked(item, "one_host", lane, "needs a server on the session's home")
    unmarked = [
        f"{item.nodeid} (uses {', '.join(sorted(SANDBOX_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if isinstance(item, pytest.Function)
        and SANDBOX_FIXTURES & set(item.fixturenames)
        and not item.get_closest_marker("sandbox")
    ]
    unmarked += [
        f"{item.nodeid} (a cluster test: needs both cluster and sandbox)"
        for item in items
        if isinstance(item, pytest.Function)
        and (CLUSTER_FIXTURES & set(item.fixturenames) or item.get_closest_marker("cluster"))
        and not (item.get_closest_marker("cluster") and item.get_closest_marker("sandbox"))
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start sandboxes must be marked @pytest.mark.sandbox, and those that start a cluster "
            "@pytest.mark.cluster too:\n  " + "\n  ".join(unmarked)
        )


@pytest.hookimpl(trylast=True)  # after -m deselected: arm check 2 only if no sandbox test is left
def pytest_collection_finish(session: pytest.Session) -> None:
    if FAST_LANE_GUARD in session.config.stash or not session.items:
        return
    if not any(item.get_closest_marker("sandbox") for item in session.items):
        guard = session.config.stash[FAST_LANE_GUARD] = FastLaneGuard()
        sys.addaudithook(guard)  # cannot be removed; one call per audit event, in the fast lane only


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test that timed out (pytest-timeout) waiting on the sync API: add what the SDK's event
    loop was awaiting (each pending task's stack), which the thread dump cannot show."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or "Timeout" not in str(call.excinfo.value if call.excinfo else ""):
        return
    import asyncio
    import io

    from warmbox.sdk import _sync

    loop = _sync._RUNNER._loop
    if loop is None:
        return
    out = io.StringIO()
    try:
        for task in list(asyncio.all_tasks(loop)):
            out.write(f"{task!r}\n")
            coro, depth = task.get_coro(), 0
            while coro is not None and depth < 60:  # the await chain, outermost first
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    out.write(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
                coro, depth = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None), depth + 1
    except RuntimeError as e:  # the set changed under us: what was read is still useful
        out.write(f"({e})\n")
    report.sections.append(("pending tasks of the SDK's event loop", out.getvalue()))


@pytest.fixture(autouse=True)
def _fast_lane_spawns(request: pytest.FixtureRequest):
    yield
    guard = request.config.stash.get(FAST_LANE_GUARD, None)
    if guard is not None and guard.hits:
        hits, guard.hits[:] = list(guard.hits), []
        pytest.fail("not marked @pytest.mark.sandbox but started " + "; ".join(hits), pytrace=False)


def set_config(home: Path, extra: str = "") -> None:
    """Rewrite the session's warmbox.toml (base + ``extra``); the daemon picks it up on its next tick."""
    path = home / "warmbox.toml"
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(BASE_CONFIG + extra)
    st = path.stat()
    if st.st_mtime_ns <= old:
        os.utime(path, ns=(st.st_atime_ns, old + 1000))


def _cgroup_leftovers() -> list[str]:
    out = []
    base = Path("/sys/fs/cgroup")
    for d in base.glob("*/warmbox/sb-*"):
        out.append(str(d))
    for d in base.glob("warmbox/sb-*"):
        out.append(str(d))
    return out


_RUN_HOMES: list[Path] = []  # homes the session made outside its basetemp (the home fixture's)


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind(tmp_path_factory: pytest.TempPathFactory):
    """At the session's end (its other fixtures torn down first): no process, cgroup, mount or
    network namespace of a home this run made is left (tests/leftovers.py says what counts). The
    homes' daemons are stopped as ``warmbox down`` does; what else stays after a bounded settle
    fails the run, and its processes are ended by PID."""
    base = tmp_path_factory.getbasetemp()
    yield
    from tests import leftovers

    left = leftovers.check([*_RUN_HOMES, *leftovers.homes_under(base)])
    assert not left, "the test run left behind:\n  " + "\n  ".join(left)


@pytest.fixture(scope="session")
def home() -> Path:
    """A private WARMBOX_HOME (short path: unix sockets live under it)."""
    path = Path(f"/tmp/wbt-{secrets.token_hex(3)}")
    path.mkdir(mode=0o700)
    _RUN_HOMES.append(path)
    (path / "warmbox.toml").write_text(BASE_CONFIG)
    old = os.environ.get("WARMBOX_HOME")
    os.environ["WARMBOX_HOME"] = str(path)
    os.environ.pop("WARMBOX_CONFIG", None)
    before = set(_cgroup_leftovers())
    parents_before = {str(d) for d in Path("/sys/fs/cgroup").glob("*/warmbox")}
    yield path
    # every test must have cleaned up after itself; prove it, then remove what is left
    import asyncio

    from warmbox.engine.daemon import down_home
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(path)
    asyncio.run(down_home(path))  # stops the daemon; it destroys the pooled sandboxes
    live = engine.list()
    for info in live:
        asyncio.run(teardown.destroy(engine, info.sandbox_id, "test session teardown"))
    rt = engine.runtime
    runc_state = [p.name for p in (rt / "runc").iterdir()] if (rt / "runc").is_dir() else []
    # only this home's sandboxes: other warmbox homes (a parallel session) may run meanwhile
    ours = {i.sandbox_id for i in engine.list(include_dead=True)}
    leftovers = {d for d in set(_cgroup_leftovers()) - before if d.rsplit("/", 1)[-1] in ours}
    sandboxes = [p.name for p in (rt / "sandboxes").iterdir()] if (rt / "sandboxes").is_dir() else []
    from warmbox.backends import workspace_disk

    mounts, loops = workspace_disk.mounts_under(rt), workspace_disk.loops_backed_by(rt)
    for name in sandboxes:  # never rmtree through a mounted workspace disk
        try:
            workspace_disk.release(rt / "sandboxes" / name)
        except OSError:
            pass
    _stop_daemon(path)
    for d in Path("/sys/fs/cgroup").glob("*/warmbox"):  # runc's parent cgroups, if we made them
        if str(d) not in parents_before:
            try:
                d.rmdir()
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(rt, ignore_errors=True)
    if old is None:
        os.environ.pop("WARMBOX_HOME", None)
    else:
        os.environ["WARMBOX_HOME"] = old
    assert not live, f"tests left live sandboxes: {[i.sandbox_id for i in live]}"
    assert not runc_state, f"runc containers left: {runc_state}"
    assert not leftovers, f"cgroups left: {sorted(leftovers)}"
    assert not sandboxes, f"sandbox dirs left: {sandboxes}"
    assert not mounts, f"mounts left under {rt}: {mounts}"
    assert not loops, f"loop devices left backed by files under {rt}: {loops}"


def _stop_daemon(path: Path) -> None:
    """End the reaper this session's home started (found by its command line, ended by PID)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"warmbox.engine.daemon" in cmd and str(path).encode() in cmd:
            try:
                os.kill(int(proc.name), 15)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def runc_ready(home: Path) -> None:
    from warmbox.engine.engine import Engine

    avail = Engine.for_home(home).backend("container").probe()
    if not avail.available:
        pytest.fail(f"the container tier must run here (scripts/bootstrap installs it): {avail.reason}")


def wait_for(pred, timeout: float = 60.0, what: str = "condition", interval: float = 0.1):
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def pooled_sandbox(home: Path, cluster=None, **kw):
    """A sandbox handed out by the ``iso`` warm pool (waits for the pool to have one): the home's,
    or with ``cluster`` (tests/cluster/harness.py) the cluster's, which its nodes share."""
    from warmbox import Limits, Sandbox, State
    from warmbox.engine.engine import Engine

    if cluster is None:
        engine = Engine.for_home(home)
        engine.ensure_daemon()
        wait_for(lambda: engine.registry.pools.pool_counts("iso")[0] >= 1, 120, "the iso pool to fill")
    else:

        def ready() -> bool:
            rows = cluster.registry().sandboxes.list(include_pooled=True, states=(State.POOLED,))
            return any(info.pool == "iso" for info, _h in rows)

        wait_for(ready, 120, "the cluster's iso pool to fill")
    box = Sandbox.create(limits=Limits(memory_mb=POOLED_LIMITS_MB), **kw)
    assert box.from_pool, "the iso pool had a ready sandbox but create() did not take it"
    return box


@pytest.fixture(scope="module", params=["cold", "pooled"])
def sb(request, home: Path, runc_ready: None):
    """One sandbox shared by the read-only checks of a module: created cold, and from a pool."""
    from warmbox import Sandbox

    if request.param == "cold":
        box = Sandbox.create(timeout=600, envs={"GREETING": "hi"})
        assert not box.from_pool
    else:
        cluster = request.getfixturevalue("cluster") if over_cluster(request.node) else None
        box = pooled_sandbox(home, cluster, timeout=600, envs={"GREETING": "hi"})
    with box:
        yield box


def host_python() -> str:
    return sys.executable


def cli(
    *args: str, env: dict | None = None, timeout: float = 120, input: str | None = None
) -> subprocess.CompletedProcess:
    """The CLI in its own process; ``input``: piped to its stdin (else /dev/null, which it never forwards)."""
    return subprocess.run(
        [sys.executable, "-m", "warmbox.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        stdin=subprocess.DEVNULL if input is None else None,
        env={**os.environ, **(env or {})},
    )


# ---- a real `warmbox serve` (the --api=http lane and tests/server)


@dataclasses.dataclass
class ServerProc:
    """A `warmbox serve` subprocess: its TCP URL (or ""), its unix socket, where its output goes."""

    proc: subprocess.Popen
    url: str
    socket: Path
    log: Path
    client_env: dict[str, str] = dataclasses.field(default_factory=dict)  # what a client sets to use it

    @property
    def unix_url(self) -> str:
        return f"unix:{self.socket}"

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill9(self) -> None:
        """SIGKILL by PID (a crash); the socket file stays behind, as after a real crash."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM, SIGKILL after ``grace`` s; the exit status (the server must be gone after)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        assert self.proc.poll() is not None, f"warmbox serve (pid {self.proc.pid}) did not exit"
        return self.proc.returncode


_LISTENING = re.compile(r"^listening on (.*)$", re.M)


def start_server(
    home: Path,
    socket: Path | None = None,
    *,
    tcp: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    args: tuple[str, ...] = (),
    mcp: bool = False,
) -> ServerProc:
    """Start `python -m warmbox.cli.main serve` on ``home`` and wait (bounded) for its listening line;
    ``args``: more of serve's options (e.g. ``("--cluster", HEAD)``: the cluster's router); ``mcp``:
    serve MCP at /mcp too."""
    socket = socket or home / "api.sock"
    log = home / f"serve-{secrets.token_hex(3)}.log"
    where = ["--port", "0"] if tcp else ["--host", ""]
    child_env = {k: v for k, v in os.environ.items() if k not in ("WARMBOX_API_URL", "WARMBOX_API_KEY")}
    child_env.update(WARMBOX_HOME=str(home), **(env or {}))
    no_mcp = () if mcp else ("--no-mcp",)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmbox.cli.main", "serve", *where, "--socket", str(socket), *no_mcp, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
        )
    server = ServerProc(proc, "", socket, log)
    deadline = time.monotonic() + timeout
    while True:
        m = _LISTENING.search(server.output())
        if m:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop(grace=5)
            raise AssertionError(f"warmbox serve did not start (exit {proc.returncode}):\n{server.output()}")
        time.sleep(0.05)
    for address in m.group(1).split(" and "):
        if address.startswith(("http://", "https://")):
            server.url = address
    return server


@pytest.fixture(scope="session")
def api_server(home: Path):
    """The --api=http lane's server on the session home and the client's settings for it: over TCP
    with a key of tenant "pytest". Ended by PID."""
    from warmbox.engine.engine import Engine

    server = start_server(home)
    try:
        _key_id, secret = Engine.for_home(home).registry.tenants.create_key("pytest")
        server.client_env = {"WARMBOX_API_URL": server.url, "WARMBOX_API_KEY": secret}
        yield server
    finally:
        status = server.stop()
        assert status == 0, f"warmbox serve exited with {status} on SIGTERM:\n{server.output()}"


@pytest.fixture(scope="module", autouse=True)
def _api_lane(request: pytest.FixtureRequest):
    """In the --api=http|cluster lanes: WARMBOX_API_URL (+ KEY) set for the module (before its
    module-scoped fixtures make sandboxes), so every Sandbox.create()/connect() and cli(...) goes over
    HTTP, to the session's server or to the cluster's router."""
    lane = api_lane(request.node)
    if not lane:
        yield
        return
    server = request.getfixturevalue("api_server" if lane == "http" else "cluster")
    saved = {k: os.environ.get(k) for k in ("WARMBOX_API_URL", "WARMBOX_API_KEY")}
    os.environ.pop("WARMBOX_API_KEY", None)
    os.environ.update(server.client_env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- shared services


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (bucket tests.s3server.BUCKET), one per session; ``.env``: what a
    client process sets to reach it. Leaves os.environ alone. Ended by PID."""
    from tests.s3server import S3Server

    server = S3Server.start()
    try:
        yield server
    finally:
        server.stop()


# ---- PostgreSQL: one real server per session (tests/pgserver.py), a database per use


@pytest.fixture(scope="session")
def pg_server():
    """The session's PostgreSQL server (Debian's, as user postgres, on a unix socket in a temp dir)."""
    from tests.pgserver import PgServer

    pg = PgServer()
    yield pg
    pg.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server) -> str:
    """A database made once for the session (shared by everything that uses it: a cluster's nodes)."""
    return pg_server.create_database("warmbox")


@pytest.fixture
def pg_fresh_dsn(pg_server):
    """A new empty database for one test (~35 ms), dropped after it."""
    dsn = pg_server.create_database()
    yield dsn
    pg_server.drop_database(dsn)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.sandbox)])
def registry_at(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a test's registry lives, once per kind: a SQLite file, or a fresh PostgreSQL database
    (its DSN; that variant is marked sandbox: it starts the session's server)."""
    if request.param == "sqlite":
        return str(tmp_path / "r.db")
    return request.getfixturevalue("pg_fresh_dsn")


@pytest.fixture(scope="session")
def cluster(runc_ready: None, pg_dsn: str, s3_server):
    """A real cluster on this host (tests/cluster/harness.py): PostgreSQL, moto S3, a Ray head, 3
    `warmbox node join` processes, the router. One per session (the --api=cluster lane's server and
    tests/cluster's subject). Its teardown proves nothing is left (processes, containers, dirs)."""
    from tests.cluster.harness import Cluster

    c = Cluster.start(pg_dsn, s3_server)
    try:
        yield c
    finally:
        problems = c.stop()
        assert not problems, "the cluster's teardown found:\n" + "\n".join(problems)
