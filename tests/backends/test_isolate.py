"""Tier 1 (isolate): a real V8 isolate per sandbox in the jailed host process, through the SDK."""

from __future__ import annotations

import base64

import pytest

from warmbox import InvalidArgument, Limits, Sandbox, Unsupported, UnsupportedLanguage
from warmbox.backends.isolate import IsolateBackend
from warmbox.engine.engine import Engine


def isolate_backend(home) -> IsolateBackend:
    backend = Engine.for_home(home).backend("isolate")
    assert isinstance(backend, IsolateBackend)
    avail = backend.probe()
    if not avail.available:
        pytest.fail(f"the isolate tier must run here (scripts/bootstrap install builds it): {avail.reason}")
    return backend


def test_without_its_engine_the_tier_is_unavailable_saying_how_to_build_it(tmp_path):
    avail = IsolateBackend(tmp_path, engine_dir=tmp_path / "missing").probe()
    assert not avail.available and "scripts/bootstrap install" in avail.reason


def test_capabilities_say_what_an_isolate_lacks(tmp_path):
    caps = IsolateBackend(tmp_path).capabilities()
    assert caps.context_languages == ("javascript", "wasm") and caps.network_modes == ("none",)
    assert not (caps.commands or caps.files or caps.ports or caps.images or caps.filesystem_snapshot)
    assert caps.start_class == "~1ms" and caps.oom_counted_in_guest


@pytest.fixture(scope="module")
def iso_host(home, runc_ready):
    """The isolate host of this home, stopped (with its container and cgroup) after the module."""
    backend = isolate_backend(home)
    yield backend
    backend.stop_host()
    assert backend.host_pid() is None


@pytest.fixture(scope="module")
def box(iso_host):
    with Sandbox.create(tier="isolate", timeout=600) as sb:
        yield sb


@pytest.mark.sandbox
def test_last_value_console_and_state_survive_between_runs(box):
    e = box.run_code("let greeting = 'ab'; console.log('hi', 1, {a: [1, 2]}); greeting.toUpperCase()", language="js")
    assert e.error is None, e.error
    assert e.text == "'AB'" and e.stdout == "hi 1 { a: [ 1, 2 ] }\n"
    again = box.run_code("greeting + '!'", language="javascript")  # a top-level let survives
    assert again.text == "'ab!'" and again.execution_count == e.execution_count + 1
    assert box.run_code("console.error('bad')", language="javascript").stderr == "bad\n"
    assert box.run_code("({n: 1, list: [1, 'x']})", language="javascript").text == "{ n: 1, list: [ 1, 'x' ] }"
    assert box.run_code("(function named() {})", language="javascript").text == "[Function: named]"


@pytest.mark.sandbox
def test_a_js_exception_is_the_typed_error_of_the_run(box):
    e = box.run_code("function f() { throw new TypeError('boom') }\nf()", language="javascript")
    assert e.error is not None and (e.error.name, e.error.value) == ("TypeError", "boom")
    assert "at f (" in e.error.traceback and "isolated-vm boundary" not in e.error.traceback
    assert not e.timed_out and not e.oom_killed and e.text is None
    syntax = box.run_code("let = = 1", language="javascript")
    assert syntax.error is not None and syntax.error.name == "SyntaxError"


@pytest.mark.sandbox
def test_a_template_is_refused_not_ignored(iso_host):
    with pytest.raises(InvalidArgument, match="takes no template"):
        Sandbox.create(tier="isolate", template="pydata", timeout=60)


@pytest.mark.sandbox
def test_commands_and_files_are_unsupported_naming_the_capabilities(box):
    with pytest.raises(Unsupported) as err:
        box.commands.run("echo hi")
    assert err.value.tier == "isolate" and "no commands" in str(err.value) and "javascript" in str(err.value)
    with pytest.raises(Unsupported, match="has no filesystem"):
        box.files.read("/etc/passwd")
    with pytest.raises(Unsupported):
        box.files.write("/tmp/x", "y")
    with pytest.raises(UnsupportedLanguage):
        box.run_code("1 + 1", language="python")


@pytest.mark.sandbox
def test_a_loop_times_out_and_an_allocation_is_oom_killed_while_others_continue(box, iso_host):
    other = Sandbox.create(tier="isolate", timeout=600, limits=Limits(memory_mb=64))
    try:
        box.run_code("var survivor = 41", language="javascript")
        pid = iso_host.host_pid()
        loop = box.run_code("while (true) {}", language="javascript", timeout=0.5)
        assert loop.timed_out and loop.error is None
        assert box.run_code("survivor + 1", language="javascript").text == "42"  # the isolate kept its state
        oom = other.run_code("const a = []; while (true) a.push(new Array(1e6).fill(1.5))", language="javascript")
        assert oom.oom_killed and oom.error is not None and oom.error.name == "MemoryLimitError"
        # an ArrayBuffer counts against the limit too (it is not V8 heap)
        big = other.run_code("new Uint8Array(1e9).fill(1).length", language="javascript")
        assert big.error is not None and not big.text
        assert other.run_code("'fresh'", language="javascript").text == "'fresh'"  # a new isolate took its place
        assert box.run_code("survivor", language="javascript").text == "41"
        assert iso_host.host_pid() == pid  # the host process survived every limit
    finally:
        other.kill()


@pytest.mark.sandbox
def test_a_warm_pool_of_isolates_hands_out_ready_sandboxes(iso_host, home):
    from tests.conftest import set_config, wait_for

    engine = Engine.for_home(home)
    set_config(
        home,
        """
[pools.t-iso]
tier = "isolate"
template = "base"
min = 2
max = 2
target = 2
limits = { memory_mb = 64 }
""",
    )
    try:
        engine.ensure_daemon()
        wait_for(lambda: engine.registry.pools.pool_counts("t-iso")[0] >= 2, 60, "the isolate pool to fill")
        pooled = set(engine.registry.pools.pooled("t-iso"))
        with Sandbox.create(tier="isolate", limits=Limits(memory_mb=64)) as sb:
            assert sb.from_pool and sb.sandbox_id in pooled
            assert sb.run_code("'ab'.toUpperCase()", language="javascript").text == "'AB'"
            assert "allocation" in {t.stage for t in sb.stage_timings}
        # the refill makes another: the pool is back at its target
        wait_for(lambda: engine.registry.pools.pool_counts("t-iso")[0] >= 2, 60, "the isolate pool to refill")
    finally:
        set_config(home)
    wait_for(lambda: not engine.registry.pools.pooled("t-iso"), 60, "the isolate pool to be retired")


HELLO_WASI = """(module
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 8) "hello wasm\\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 8))
    (i32.store (i32.const 4) (i32.const 11))
    (drop (call $write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 20)))))"""
ANSWER = '(module (func (export "main") (result i32) i32.const 42))'


@pytest.mark.sandbox
def test_wasm_modules_run_as_text_or_binary_with_wasi_output(box):
    e = box.run_code(HELLO_WASI, language="wasm")
    assert e.error is None and e.stdout == "hello wasm\n" and e.text is None
    assert box.run_code(ANSWER, language="wasm").text == "42"
    # the binary form, base64 (the same module: magic, version, type, function, export and code sections)
    binary = bytes.fromhex("0061736d010000000105016000017f03020100070801046d61696e00000a06010400412a0b")
    assert box.run_code(base64.b64encode(binary).decode(), language="wasm").text == "42"
    bad = box.run_code("not a module", language="wasm")
    assert bad.error is not None and bad.error.name == "ValueError"
    trap = box.run_code('(module (func (export "main") unreachable))', language="wasm")
    assert trap.error is not None and trap.error.name == "Trap" and "unreachable" in trap.error.value
    exit3 = box.run_code(
        '(module (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))'
        ' (memory (export "memory") 1) (func (export "_start") (call $exit (i32.const 3))))',
        language="wasm",
    )
    assert exit3.error is not None and (exit3.error.name, exit3.error.value) == ("WasiExit", "exit code 3")
    assert box.run_code("'js and wasm side by side'", language="javascript").error is None


@pytest.mark.sandbox
def test_a_control_client_that_leaves_early_never_ends_the_host(box, iso_host):
    """The engine giving up on a control answer (its socket closed before the host writes) once
    ended the host: an EPIPE on a socket without an 'error' handler ends Node.js."""
    import json
    import socket

    pid = iso_host.host_pid()
    path = str(iso_host.host("").control_path)
    for _ in range(40):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(json.dumps({"op": "stats"}).encode())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # one that never sends: answered, not waited on
        s.connect(path)
        s.settimeout(10)
        assert b"no request" in s.recv(4096)
    assert iso_host.host_pid() == pid
    assert box.run_code("'still here'", language="javascript").text == "'still here'"
