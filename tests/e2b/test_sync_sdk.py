"""The official E2B Python SDKs (sync) against a real `warmbox serve`: commands, files, code, the
control plane, and two tenants' walls. One code-interpreter sandbox serves the module."""

from __future__ import annotations

import base64
import io
import itertools
import os
import time
import uuid

import pytest

pytestmark = pytest.mark.sandbox

e2b = pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")
from e2b_code_interpreter import Sandbox  # noqa: E402


@pytest.fixture(scope="module")
def sb(e2b_server):
    tag = uuid.uuid4().hex[:8]
    sandbox = Sandbox.create(timeout=600, metadata={"lane": "e2b-sync", "tag": tag})
    sandbox.test_tag = tag  # type: ignore[attr-defined]
    try:
        yield sandbox
    finally:
        sandbox.kill()


# ---- commands


def test_foreground_command_output_exit_code_envs_and_cwd(sb):
    r = sb.commands.run("echo out; echo err >&2; echo $GREETING; pwd", envs={"GREETING": "hej"}, cwd="/tmp")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\nhej\n/tmp\n", "err\n", 0)
    with pytest.raises(e2b.CommandExitException) as info:
        sb.commands.run("echo no >&2; exit 3")
    assert info.value.exit_code == 3 and info.value.stderr == "no\n"
    # the sandbox's PATH, not the one Debian's /etc/profile sets for a login shell: pip is the venv's
    assert sb.commands.run("command -v pip python3").stdout.split() == [
        "/home/user/.venv/bin/pip",
        "/home/user/.venv/bin/python3",
    ]


def test_streamed_output_reaches_the_callbacks(sb):
    got: list[str] = []
    sb.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=got.append)
    assert "".join(got) == "1\n2\n3\n"


def test_stdin_is_closed_unless_asked_for(sb):
    r = sb.commands.run("cat; echo done")  # E2B: stdin=False gives the command EOF at once
    assert r.stdout == "done\n"


def test_background_command_stdin_list_connect_and_kill(sb):
    h = sb.commands.run("cat", background=True, stdin=True)
    assert h.pid > 0
    assert h.pid in [p.pid for p in sb.commands.list()]
    sb.commands.send_stdin(h.pid, "line one\n")
    sb.commands.close_stdin(h.pid)
    assert h.wait().stdout == "line one\n"

    streamed = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.stream_input(streamed.pid, ["a\n", b"b\n"])  # StreamInput: a client stream
    sb.commands.close_stdin(streamed.pid)
    assert streamed.wait().stdout == "a\nb\n"

    sleeper = sb.commands.run("echo started; sleep 600", background=True)
    again = sb.commands.connect(sleeper.pid)
    assert again.pid == sleeper.pid
    assert sb.commands.kill(sleeper.pid) is True
    with pytest.raises(e2b.CommandExitException):
        again.wait()
    assert sleeper.pid not in [p.pid for p in sb.commands.list()]
    assert sb.commands.kill(sleeper.pid) is False  # not running any more


def test_root_is_refused_on_a_tier_without_it_naming_the_tier(sb):
    with pytest.raises(e2b.InvalidArgumentException, match="container"):
        sb.commands.run("id -u", user="root")
    assert sb.commands.run("id -un", user="user").stdout == "user\n"


def test_pty_runs_an_interactive_shell(sb):
    h = sb.pty.create(e2b.PtySize(rows=24, cols=80))
    sb.pty.resize(h.pid, e2b.PtySize(rows=30, cols=100))
    sb.pty.send_stdin(h.pid, b"stty size; echo pty-$((40 + 2)); command -v pip; exit\n")
    seen = bytearray()
    h.wait(on_pty=seen.extend)
    text = seen.decode(errors="replace")
    assert "30 100" in text and "pty-42" in text and "/home/user/.venv/bin/pip" in text


# ---- files


def test_files_write_read_list_stat_rename_remove(sb):
    info = sb.files.write("/workspace/e2b/notes.txt", "hello\n")
    assert info.path == "/workspace/e2b/notes.txt"
    sb.files.write_files(
        [{"path": "/workspace/e2b/a.bin", "data": b"\x00\x01"}, {"path": "/workspace/e2b/b.txt", "data": "b"}]
    )
    assert sb.files.read("/workspace/e2b/notes.txt") == "hello\n"
    assert bytes(sb.files.read("/workspace/e2b/a.bin", format="bytes")) == b"\x00\x01"
    assert sorted(e.name for e in sb.files.list("/workspace/e2b")) == ["a.bin", "b.txt", "notes.txt"]
    st = sb.files.get_info("/workspace/e2b/notes.txt")
    assert (st.size, st.type, st.permissions) == (6, e2b.FileType.FILE, "-rw-r--r--")
    assert sb.files.make_dir("/workspace/e2b/sub") is True
    assert sb.files.make_dir("/workspace/e2b/sub") is False
    moved = sb.files.rename("/workspace/e2b/notes.txt", "/workspace/e2b/sub/notes.txt")
    assert moved.path == "/workspace/e2b/sub/notes.txt"
    assert sb.files.exists("/workspace/e2b/sub/notes.txt") and not sb.files.exists("/workspace/e2b/notes.txt")
    sb.files.remove("/workspace/e2b/sub")
    assert not sb.files.exists("/workspace/e2b/sub")
    with pytest.raises(e2b.NotFoundException):
        sb.files.read("/workspace/e2b/missing.txt")
    # what the commands see is what the files API wrote
    assert sb.commands.run("cat /workspace/e2b/b.txt").stdout == "b"


def test_large_gzip_and_streamed_transfers(sb):
    data = os.urandom(3 << 20)
    sb.files.write("/workspace/big.bin", data)  # multipart
    assert bytes(sb.files.read("/workspace/big.bin", format="bytes")) == data
    assert b"".join(sb.files.read("/workspace/big.bin", format="stream")) == data
    sb.files.write("/workspace/gz.txt", "z" * 100_000, gzip=True)  # octet-stream, gzip-encoded
    assert sb.files.read("/workspace/gz.txt") == "z" * 100_000
    sb.files.write("/workspace/io.bin", io.BytesIO(b"from a file object"))  # streamed octet-stream
    assert sb.files.read("/workspace/io.bin") == "from a file object"


def test_watch_dir_polled(sb):
    sb.files.make_dir("/workspace/watched")
    handle = sb.files.watch_dir("/workspace/watched")
    try:
        sb.files.write("/workspace/watched/new.txt", "x")
        seen: list = []
        deadline = time.monotonic() + 30
        while not any(e.name == "new.txt" and e.type == e2b.FilesystemEventType.CREATE for e in seen):
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
            seen += handle.get_new_events()
    finally:
        handle.stop()
    with pytest.raises(e2b.SandboxException):
        handle.get_new_events()  # stopped


# ---- code


def test_run_code_text_stdout_and_state(sb):
    ex = sb.run_code("x = 40\nprint('side')\nx + 2")
    assert ex.text == "42" and ex.logs.stdout == ["side\n"] and ex.error is None  # one line, as Jupyter sends it
    assert sb.run_code("x").text == "40"


def test_run_code_other_languages(sb):
    assert sb.run_code("[1, 2, 3].map((n) => n * 2).length", language="js").text == "3"
    ex = sb.run_code("echo from-bash", language="bash")
    assert ex.logs.stdout == ["from-bash\n"] and ex.error is None


def test_run_code_error(sb):
    ex = sb.run_code("1 / 0")
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value


def test_run_code_matplotlib_png(sb):
    ex = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert pngs and base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_code_contexts(sb):
    ctx = sb.create_code_context(cwd="/tmp")
    assert ctx.id and ctx.language == "python" and ctx.cwd == "/tmp"
    assert sb.run_code("import os\nos.getcwd()", context=ctx).text == "'/tmp'"
    sb.run_code("only_here = 1", context=ctx)
    assert sb.run_code("'only_here' in globals()").text == "False"
    listed = {c.id: c for c in sb.list_code_contexts()}
    assert (listed[ctx.id].language, listed[ctx.id].cwd) == ("python", "/tmp")
    sb.restart_code_context(ctx)  # same id, language and cwd; no state
    assert sb.run_code("import os\n('only_here' in globals(), os.getcwd())", context=ctx).text == "(False, '/tmp')"
    # env_vars for that run only
    ex = sb.run_code("import os\nos.environ['ONE_RUN']", context=ctx, envs={"ONE_RUN": "yes"})
    assert ex.text == "'yes'", ex.error
    assert sb.run_code("os.environ.get('ONE_RUN')", context=ctx).text is None
    with pytest.raises(e2b.SandboxException, match=r"400.*'NOT=VALID' is not valid"):
        sb.run_code("1", envs={"NOT=VALID": "x"})
    sb.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sb.list_code_contexts()}
    with pytest.raises(e2b.SandboxException):
        sb.run_code("1", context=ctx)


# ---- the control plane


def test_info_set_timeout_and_list_by_metadata(sb):
    info = sb.get_info()
    assert (info.sandbox_id, info.template_id, info.state) == (sb.sandbox_id, "code-interpreter-v1", "running")
    assert info.metadata["tag"] == sb.test_tag
    sb.set_timeout(900)
    assert 850 < (sb.get_info().end_at.timestamp() - time.time()) <= 900
    found = Sandbox.list(query=e2b.SandboxQuery(metadata={"tag": sb.test_tag})).next_items()
    assert [s.sandbox_id for s in found] == [sb.sandbox_id]
    assert Sandbox.list(query=e2b.SandboxQuery(metadata={"tag": "no-such-tag"})).next_items() == []
    assert sb.is_running()


# ---- two tenants


def test_another_key_cannot_see_or_touch_the_sandbox(sb, e2b_server):
    other = {"api_key": e2b_server.key_b}
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**other).next_items()]
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sb.sandbox_id, **other)
    with pytest.raises(e2b.NotFoundException):
        Sandbox.set_timeout(sb.sandbox_id, 10, **other)
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect(sb.sandbox_id, **other)
    assert Sandbox.kill(sb.sandbox_id, **other) is False
    with pytest.raises(e2b.NotFoundException):
        Sandbox.pause(sb.sandbox_id, **other)
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.list(api_key="wbx_not_a_key").next_items()
    assert sb.is_running() and sb.commands.run("true").exit_code == 0


def test_raw_control_plane_v1_routes_paging_and_bad_input(sb, e2b_server):
    """What SDKs before the /v2 routes send, x-next-token paging, and E2B's 400/404 shapes."""
    import httpx

    a = {"X-API-KEY": e2b_server.key_a}
    with httpx.Client(base_url=e2b_server.server.url, timeout=60, headers=a) as http:
        r = http.post("/sandboxes", json={"templateID": "base", "timeout": 60, "metadata": {"lane": "e2b-v1"}})
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["envdVersion"] and made["envdAccessToken"] and made["templateID"] == "base"
        try:
            running = http.get("/sandboxes").json()
            assert {made["sandboxID"], sb.sandbox_id} <= {s["sandboxID"] for s in running}
            first = http.get("/v2/sandboxes", params={"limit": 1, "state": "running"})
            assert first.status_code == 200 and len(first.json()) == 1
            token = first.headers["x-next-token"]
            second = http.get("/v2/sandboxes", params={"limit": 1, "state": "running", "nextToken": token})
            assert second.json()[0]["sandboxID"] != first.json()[0]["sandboxID"]
            for bad in (b"[1]", b"{", b'{"templateID": 5}', b'{"templateID": "base", "timeout": "x"}'):
                r = http.post("/v2/sandboxes", content=bad, headers={"Content-Type": "application/json"})
                assert (r.status_code, r.json()["code"]) == (400, 400), bad
            r = http.post("/v2/sandboxes", json={"templateID": "no-such-template"})
            assert (r.status_code, r.json()["code"]) == (400, 400) and "no-such-template" in r.json()["message"]
            sid = made["sandboxID"]
            for path, bad in (
                ("fork", {"count": 21}),
                ("fork", {"count": "2"}),
                ("snapshots", {"name": "named"}),
                ("snapshots", {"memory": "yes"}),
            ):
                r = http.post(f"/sandboxes/{sid}/{path}", json=bad)
                assert (r.status_code, r.json()["code"]) == (400, 400), (path, bad)
            for bad in ({"dnsServers": ["10.0.0.1"]}, {"allowOut": "example.com"}, {"allowInternetAccess": "yes"}):
                r = http.put(f"/sandboxes/{sid}/network", json=bad)
                assert (r.status_code, r.json()["code"]) == (400, 400), bad
            for bad in ({"limit": "0"}, {"nextToken": "!"}):
                r = http.get("/snapshots", params=bad)
                assert (r.status_code, r.json()["code"]) == (400, 400), bad
            assert http.delete("/templates/base").status_code == 400  # templates: warmbox's own API
            many = "&".join(f"k{i}=v" for i in range(65))
            for bad_query in ({"metadata": many}, {"metadata": "no-equals-sign"}, {"state": "dead"}, {"limit": "0"}):
                r = http.get("/v2/sandboxes", params=bad_query)
                assert (r.status_code, r.json()["code"]) == (400, 400), bad_query
            r = http.put("/v2/sandboxes", json={})
            assert (r.status_code, r.json()["code"]) == (405, 405)
        finally:
            assert http.delete(f"/sandboxes/{made['sandboxID']}").status_code == 204
        assert http.get(f"/sandboxes/{made['sandboxID']}").status_code == 404
        # a malformed multipart upload is E2B's 400, never a 500
        envd = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": sb._envd_access_token}
        broken = {"Content-Type": "multipart/form-data; boundary=xyz"}
        r = http.post(
            "/files", content=b'--xyz\r\nContent-Disposition: form-data; name="file"', headers={**envd, **broken}
        )
        assert r.status_code == 400, r.text
        fields = b"".join(b'--xyz\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n' % i for i in range(1001))
        r = http.post("/files", content=fields + b"--xyz--\r\n", headers={**envd, **broken})  # the parser's limit
        assert (r.status_code, r.json()["code"]) == (400, 400), r.text
        r = http.post("/execute", content=b"[]", headers={**envd, "E2b-Sandbox-Port": "49999"})
        assert (r.status_code, r.json()["code"]) == (400, 400)


def test_metrics_history_of_one_and_of_many(sb, e2b_server):
    """A reading every 5 s (one taken at once if the latest is older), start/end as E2B's SDK sends
    them (whole seconds), warmbox's own SDK reading the same history, and the many-sandbox route."""
    import httpx

    from warmbox import Sandbox as WbSandbox

    got = sb.get_metrics()
    deadline = time.monotonic() + 30
    while len(got) < 2:  # the module's sandbox is older than 5 s by now, unless run alone
        assert time.monotonic() < deadline, got
        time.sleep(1)
        got = sb.get_metrics()
    assert all(m.cpu_count >= 1 and 0 < m.mem_used <= m.mem_total and 0 <= m.cpu_used_pct <= 100 for m in got)
    at = [m.timestamp.timestamp() for m in got]
    assert at == sorted(at) and all(b - a >= 4 for a, b in itertools.pairwise(at)), at  # whole seconds
    assert len(got) <= 720
    first, last = got[0].timestamp, got[-1].timestamp
    assert [m.timestamp for m in sb.get_metrics(end=first)] == [first]
    assert sb.get_metrics(start=last)[0].timestamp == last
    same = WbSandbox.connect(sb.sandbox_id, api_url=e2b_server.server.url, api_key=e2b_server.key_a)
    try:
        ours = same.get_metrics(start=first.timestamp(), end=last.timestamp() + 0.999)  # E2B's: whole seconds
        assert [int(m.timestamp) for m in ours] == [int(t) for t in at]
        assert ours[0].memory_bytes == got[0].mem_used
    finally:
        same.close()
    url = e2b_server.server.url
    with httpx.Client(base_url=url, timeout=60, headers={"X-API-KEY": e2b_server.key_a}) as http:
        nobody = "sb-000000000000"
        r = http.get("/sandboxes/metrics", params={"sandbox_ids": f"{sb.sandbox_id},{nobody}"})
        assert r.status_code == 200 and set(r.json()["sandboxes"]) == {sb.sandbox_id}, r.text
        assert r.json()["sandboxes"][sb.sandbox_id]["memTotal"] == got[0].mem_total
        many = ",".join(f"sb-{i:012x}" for i in range(101))
        for bad in ({"sandbox_ids": ""}, {"sandbox_ids": many}):
            r = http.get("/sandboxes/metrics", params=bad)
            assert (r.status_code, r.json()["code"]) == (400, 400), bad
        for bad in ({"start": "x"}, {"start": "-1"}, {"start": "20", "end": "10"}):
            r = http.get(f"/sandboxes/{sb.sandbox_id}/metrics", params=bad)
            assert (r.status_code, r.json()["code"]) == (400, 400), bad
        b = {"X-API-KEY": e2b_server.key_b}
        r = http.get("/sandboxes/metrics", params={"sandbox_ids": sb.sandbox_id}, headers=b)
        assert r.json() == {"sandboxes": {}}


def test_logs_both_routes_bounded_and_without_host_paths(sb, e2b_server, home):
    import httpx

    with httpx.Client(base_url=e2b_server.server.url, timeout=60, headers={"X-API-KEY": e2b_server.key_a}) as http:
        v1 = http.get(f"/sandboxes/{sb.sandbox_id}/logs", params={"limit": 5})
        assert v1.status_code == 200, v1.text
        assert len(v1.json()["logs"]) == len(v1.json()["logEntries"]) <= 5
        v2 = http.get(f"/v2/sandboxes/{sb.sandbox_id}/logs", params={"direction": "backward", "level": "debug"})
        assert v2.status_code == 200 and isinstance(v2.json()["logs"], list), v2.text
        for e in v2.json()["logs"]:
            assert e["level"] in ("debug", "info", "warn", "error") and e["timestamp"].endswith("Z")
        assert str(home) not in v1.text + v2.text
        for bad in ({"limit": "1001"}, {"direction": "sideways"}, {"level": "loud"}, {"cursor": "x"}):
            r = http.get(f"/v2/sandboxes/{sb.sandbox_id}/logs", params=bad)
            assert (r.status_code, r.json()["code"]) == (400, 400), bad
        b = {"X-API-KEY": e2b_server.key_b}
        for path in (f"/sandboxes/{sb.sandbox_id}/logs", f"/v2/sandboxes/{sb.sandbox_id}/logs"):
            assert http.get(path, headers=b).status_code == 404


def test_auto_pause_on_timeout_and_auto_resume(e2b_server):
    from e2b import Sandbox as CoreSandbox

    sb = CoreSandbox.create(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/workspace/k.txt", "kept")
        deadline = time.monotonic() + 60
        while CoreSandbox.get_info(sb.sandbox_id).state != "paused":
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(0.3)
        ran = sb.get_metrics()
        time.sleep(1)
        assert sb.get_metrics() == ran  # nothing runs: no new reading
        assert sb.files.read("/workspace/k.txt") == "kept"  # the next use resumes it, same id
        assert CoreSandbox.get_info(sb.sandbox_id).state == "running"
    finally:
        sb.kill()


def test_network_allow_out_is_warmbox_allowlist(e2b_server):
    from e2b import Sandbox as CoreSandbox

    from warmbox import Sandbox as WbSandbox

    sb = CoreSandbox.create(network={"allow_out": ["example.com", "10.1.2.0/24"], "deny_out": ["0.0.0.0/0"]})
    try:
        same = WbSandbox.connect(sb.sandbox_id, api_url=e2b_server.server.url, api_key=e2b_server.key_a)
        policy = same.network.policy()
        assert "example.com" in policy and "10.1.2.0/24" in policy and policy.startswith("allow"), policy
        same.close()
    finally:
        sb.kill()
    plain = CoreSandbox.create(allow_internet_access=True)  # deny-all stays warmbox's default
    try:
        same = WbSandbox.connect(plain.sandbox_id, api_url=e2b_server.server.url, api_key=e2b_server.key_a)
        assert same.network.policy() == "none"
        same.close()
    finally:
        plain.kill()


def test_snapshots_fork_network_update_and_their_walls(e2b_server):
    """create_snapshot (the sandbox runs on), list_snapshots, create from a snapshot's id, fork,
    delete_snapshot and update_network through E2B's SDK; key B reaches none of them."""
    from e2b import Sandbox as CoreSandbox

    from warmbox import Sandbox as WbSandbox

    other = {"api_key": e2b_server.key_b}
    src = CoreSandbox.create(timeout=120)
    made = []
    try:
        src.files.write("state.txt", "v1")
        snap = src.create_snapshot()
        assert snap.snapshot_id.startswith("snap-") and snap.names == []
        src.files.write("state.txt", "v2")  # the source runs on
        listed = [s.snapshot_id for s in src.list_snapshots().next_items()]
        assert listed == [snap.snapshot_id]
        assert snap.snapshot_id in [s.snapshot_id for s in CoreSandbox.list_snapshots().next_items()]
        assert snap.snapshot_id not in [s.snapshot_id for s in CoreSandbox.list_snapshots(**other).next_items()]
        with pytest.raises(e2b.SandboxException) as refused:
            CoreSandbox.create(snap.snapshot_id, **other)
        assert refused.value.status_code == 404
        assert CoreSandbox.delete_snapshot(snap.snapshot_id, **other) is False
        with pytest.raises(e2b.NotFoundException):
            CoreSandbox.fork(src.sandbox_id, **other)
        with pytest.raises(e2b.NotFoundException):
            CoreSandbox.create_snapshot(src.sandbox_id, **other)
        with pytest.raises(e2b.NotFoundException):
            CoreSandbox.update_network(src.sandbox_id, {"allow_out": ["example.com"]}, **other)
        made.append(CoreSandbox.create(snap.snapshot_id, timeout=60))
        assert made[0].files.read("state.txt") == "v1"
        forks = src.fork(count=2, timeout=60)
        made += [f for f in forks if isinstance(f, CoreSandbox)]
        assert len(made) == 3, forks
        assert [f.files.read("state.txt") for f in forks] == ["v2", "v2"]
        assert len({f.sandbox_id for f in [src, *made]}) == 4
        assert [s.snapshot_id for s in src.list_snapshots().next_items()] == [snap.snapshot_id]  # the fork's went
        assert CoreSandbox.delete_snapshot(snap.snapshot_id) is True
        assert CoreSandbox.delete_snapshot(snap.snapshot_id) is False
        src.update_network({"allow_out": ["example.com", "10.1.2.0/24"]})
        same = WbSandbox.connect(src.sandbox_id, api_url=e2b_server.server.url, api_key=e2b_server.key_a)
        try:
            policy = same.network.policy()
            assert "example.com" in policy and "10.1.2.0/24" in policy, policy
            src.update_network({})  # replaced whole: nothing allowed
            assert same.network.policy() == "none"
        finally:
            same.close()
    finally:
        for s in (src, *made):
            s.kill()
