"""The code-context kernels outside any sandbox: the real agent on a temp socket (as test_agent.py),
its Python kernel's charts and MIME bundles, the JavaScript and bash kernels, frame by frame."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.guest.test_agent import BARE, _await_listening, _unified
from warmbox import protocol as p
from warmbox.backends.runc import GUEST_LIB, build_image
from warmbox.engine.guest_client import GuestClient


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return build_image(tmp_path_factory.mktemp("images"))


@pytest.fixture()
def agent(image: Path, tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    lib = image / GUEST_LIB.lstrip("/")
    sock = tmp_path / "a.sock"
    boot = f"import sys; sys.path.insert(0, {str(lib)!r}); from warmbox.guest.agent import main; main()"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "MATPLOTLIBRC": str(image / "etc/matplotlibrc")}
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot, str(sock)], cwd=tmp_path, env=env)
    _await_listening(sock)
    yield str(sock), home
    proc.kill()
    proc.wait()


async def _run(c: GuestClient, code: str, context: str = "default", timeout: float = 30) -> list[p.Message]:
    out: list[p.Message] = []
    run = lambda i: p.ContextRun(i, context=context, code=code, timeout_s=timeout, max_output=1 << 20)  # noqa: E731
    async with c.request(run) as s:
        while True:
            m = await s.get()
            out.append(m)
            if isinstance(m, (p.CodeDone, p.Failure)):
                return out


def _cells(sock: str, *codes: str, context: str = "default") -> list[list[p.Message]]:
    async def go():
        c = await GuestClient.connect(sock, "t")
        try:
            return [await _run(c, code, context) for code in codes]
        finally:
            await c.close()

    return asyncio.run(go())


def _displays(msgs: list[p.Message]) -> list[tuple[int, str, bool]]:
    return [(m.result, m.mime, m.main) for m in msgs if isinstance(m, p.Display)]


def test_charts_and_bundles_frame_by_frame(agent, image):
    image_dir = image
    if subprocess.run([BARE, "-c", "import matplotlib"], capture_output=True).returncode != 0:
        pytest.skip(f"{BARE} has no matplotlib")
    sock, home = agent
    show, last, bundle = _cells(
        sock,
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nprint('after')",
        "fig = plt.figure()\nfig",
        "class B:\n  def _repr_mimebundle_(self, **kw): return {'text/html': '<i>', 'image/png': 'iVBORw=='}\nB()",
    )
    # show(): the figure's PNG, then its text/plain (which closes the result), before the print
    assert _displays(show) == [(0, "image/png", False), (0, "text/plain", False)]
    assert [type(m).__name__ for m in show][2:] == ["Stdout", "Stdout", "CodeDone"]
    assert next(m for m in show if isinstance(m, p.Display)).data[:8] == b"\x89PNG\r\n\x1a\n"
    assert _displays(last) == [(0, "image/png", True), (0, "text/plain", True)]  # not flushed again
    assert _displays(bundle) == [(0, "text/html", True), (0, "image/png", True), (0, "text/plain", True)]
    assert [m.data for m in bundle if isinstance(m, p.Display)][1] == b"\x89PNG"  # base64 in, raw bytes out
    # the image's font list was copied into the user's cache before matplotlib looked for it
    seeded = {f.name for f in (home / ".cache/matplotlib").iterdir()}
    assert seeded == {f.name for f in (image_dir / "opt/warmbox/matplotlib").iterdir()} and len(seeded) == 1


def test_javascript_and_bash_kernels(agent):
    sock, _ = agent

    async def go():
        c = await GuestClient.connect(sock, "t")
        try:
            js = await c.call(
                lambda i: p.ContextCreate(i, name="", language="javascript", cwd="", env={}), p.ContextCreated
            )
            sh = await c.call(lambda i: p.ContextCreate(i, name="", language="bash", cwd="", env={}), p.ContextCreated)
            bad = await c.call(
                lambda i: p.ContextCreate(i, name="", language="cobol", cwd="", env={}), p.ContextCreated
            )
            out = []
            for ctx, code in ((js, "const a = await 20; a"), (js, "a + 1"), (sh, "X=4; false"), (sh, "echo $X")):
                out.append(await _run(c, code, ctx.context))
            return bad, out
        finally:
            await c.close()

    if not shutil.which("node"):
        pytest.skip("no node on this host")
    bad, (j1, j2, b1, b2) = asyncio.run(go())
    assert isinstance(bad, p.Failure) and bad.code is p.ErrorCode.LANGUAGE_UNAVAILABLE and "javascript" in bad.message
    assert [m.data for m in j1 if isinstance(m, p.Display)] == [b"20"]
    assert [m.data for m in j2 if isinstance(m, p.Display)] == [b"21"]
    assert (b1[-1].error_name, b1[-1].error_value) == ("ExitCode", "1")
    assert b"".join(m.data for m in b2 if isinstance(m, p.Stdout)) == b"4\n" and b2[-1].error_name == ""


# ---- a Python context forked from the agent (the agent given a cgroup: container, microVM)


@pytest.fixture()
def cgroup_agent(image: Path, tmp_path: Path):
    """The agent as in a container: a cgroup v2 directory handed over (as root on the host)."""
    root = _unified()
    if root is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    cg = root / f"wb-test-{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir()
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    os.set_inheritable(fd, True)
    lib = image / GUEST_LIB.lstrip("/")
    sock = tmp_path / "a.sock"
    args = ["--cgroup-fd", str(fd), str(sock)]
    boot = f"import sys; sys.path.insert(0, {str(lib)!r}); from warmbox.guest.agent import main; main({args!r})"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot], cwd=tmp_path, env=env, pass_fds=(fd,))
    os.close(fd)
    (cg / "cgroup.procs").write_text(str(proc.pid))
    _await_listening(sock)
    yield str(sock), str(lib), proc.pid
    proc.kill()
    proc.wait()
    (cg / "cgroup.kill").write_text("1")
    for _ in range(100):
        try:
            for sub in [d for d in cg.iterdir() if d.is_dir()]:
                sub.rmdir()
            cg.rmdir()
            break
        except OSError:
            time.sleep(0.05)


FORKED = """
import ctypes, gc, os, signal, sys
me = open('/proc/self/cmdline', 'rb').read()
print(repr({{
    'forked': me == open('/proc/{agent}/cmdline', 'rb').read() and os.getppid() == {agent},
    'cwd': os.getcwd(), 'env': os.environ.get('WB_X'), 'executable': sys.executable,
    'flags': (sys.flags.isolated, sys.flags.no_site, sys.flags.ignore_environment, sys.flags.no_user_site),
    'path0': sys.path[0], 'agent_lib': {lib!r} in sys.path, 'site': 'site' in sys.modules,
    'term': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    'int': signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    'dumpable': ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), 'frozen': gc.get_freeze_count() > 0,
    'cgroup': open('/proc/self/cgroup').read().split('/')[-1].strip(),
}}))
"""


def test_a_python_context_forked_from_the_agent_is_a_fresh_interpreter(cgroup_agent, tmp_path):
    sock, lib, agent = cgroup_agent
    work = tmp_path / "work"
    work.mkdir()

    async def go():
        c = await GuestClient.connect(sock, "t")
        try:
            ctx = await c.call(
                lambda i: p.ContextCreate(i, name="", language="python", cwd=str(work), env={"WB_X": "1"}),
                p.ContextCreated,
            )
            seed = await c.call(
                lambda i: p.ContextCreate(i, name="", language="python", cwd="", env={"PYTHONHASHSEED": "0"}),
                p.ContextCreated,
            )
            state = await _run(c, FORKED.format(agent=agent, lib=lib), ctx.context)
            exec_d = await _run(c, FORKED.format(agent=agent, lib=lib), seed.context)
            spin = await _run(c, "x = 1\nwhile True: pass", ctx.context, timeout=1)
            kept = await _run(c, "x + 1", ctx.context)
            died = await _run(c, "import os; os._exit(3)", ctx.context)
            again = await _run(c, "import os; os.getpid()")  # the default context: forked anew
            return state, exec_d, spin, kept, died, again
        finally:
            await c.close()

    state, exec_d, spin, kept, died, again = asyncio.run(go())
    got = eval(b"".join(m.data for m in state if isinstance(m, p.Stdout)))
    assert got == {
        "forked": True,
        "cwd": str(work),
        "env": "1",
        "executable": BARE,  # (no venv here: the agent's HOME is not the sandbox's)
        "flags": (0, 0, 0, 0),  # as `python -u`, not the agent's -I -S
        "path0": "",
        "agent_lib": False,
        "site": True,
        "term": True,
        "int": True,
        "dumpable": 1,
        "frozen": True,
        "cgroup": got["cgroup"],
    } and got["cgroup"].startswith("cmd-"), got
    # a variable Python reads at start (the hash seed) cannot be applied to a fork: exec'd
    assert eval(b"".join(m.data for m in exec_d if isinstance(m, p.Stdout)))["forked"] is False
    assert spin[-1].timed_out and spin[-1].error_name == "KeyboardInterrupt"
    assert [m.data for m in kept if isinstance(m, p.Display)] == [b"2"]
    assert died[-1].error_name == "ContextDied"
    assert again[-1].error_name == "" and [m for m in again if isinstance(m, p.Display)]
