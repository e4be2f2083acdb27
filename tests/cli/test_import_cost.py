"""What ``import warmbox`` and ``warmbox --help`` load, pinned (issue 38): neither imports the HTTP
client, the SDK, the engine or asyncio, so the command line's start cannot grow back silently. A
module added here on purpose is a line in one of the sets below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# --help builds no command's parser and runs no table of operations or records (cli/main.py)
HELP_MODULES = {"warmbox", "warmbox.cli", "warmbox.cli.context", "warmbox.errors", "warmbox.lazy"}
NEVER = {
    "aiohttp",
    "asyncio",
    "ssl",
    "rich",
    "dataclasses",
    "typing",
    "warmbox.sdk",
    "warmbox.engine",
    "warmbox.server",
    "warmbox.backends",
    "warmbox.models",
    "warmbox.operations",
}

_PROBE = """
import contextlib, io, json, runpy, sys
if sys.argv[1] == "help":
    sys.argv = ["warmbox", "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module("warmbox.cli.main", run_name="__main__")
    except SystemExit:
        pass
else:
    import warmbox
# a module named for later (importlib's LazyLoader: warmbox.lazy) is not loaded until used
print(json.dumps(sorted(m for m, mod in sys.modules.items() if type(mod).__name__ != "_LazyModule")))
"""


def _loaded(what: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, what], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(out.stdout))


def _outside_stdlib(mods: set[str]) -> set[str]:
    return {m for m in mods if m.split(".")[0] not in sys.stdlib_module_names} - {"__main__", "_distutils_hack"}


@pytest.mark.parametrize(
    "what, warmbox_modules",
    [("import", {"warmbox"}), ("help", HELP_MODULES)],
)
def test_import_set_is_pinned(what, warmbox_modules):
    mods = _loaded(what)
    ours = {m for m in mods if m == "warmbox" or m.startswith("warmbox.")}
    assert ours == warmbox_modules, f"added: {sorted(ours - warmbox_modules)}, gone: {sorted(warmbox_modules - ours)}"
    assert _outside_stdlib(mods) == ours, "a third-party library is loaded"
    assert not {m for m in mods if any(m == n or m.startswith(n + ".") for n in NEVER)}


# the thin path (cli/thin.py: run, exec, ls, kill to a running server) talks HTTP/1.1 on a plain
# socket: no event loop, no HTTP library (http.client's email and ssl were ~15 ms), no engine; the
# operations name a template and a network policy only as field types (loaded when first resolved)
THIN_LOADS = {"dataclasses", "typing", "warmbox.models", "warmbox.operations"}
THIN_NEVER = (NEVER - THIN_LOADS) | {"http", "email", "urllib.request", "warmbox.templates", "warmbox.network.policy"}


def test_the_thin_path_loads_no_http_library_and_no_engine():
    probe = "import json, sys, warmbox.cli.main, warmbox.cli.thin; " + _PROBE.splitlines()[-1]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    mods = set(json.loads(out.stdout))
    assert not {m for m in mods if any(m == n or m.startswith(n + ".") for n in THIN_NEVER)}
    assert _outside_stdlib(mods) == {m for m in mods if m.split(".")[0] == "warmbox"}, "a third-party library"


def test_public_names_still_resolve():
    """The lazy re-exports of warmbox/__init__.py: every name of __all__ is there on first use."""
    out = subprocess.run(
        [sys.executable, "-c", "import warmbox; print(all(getattr(warmbox, n) is not None for n in warmbox.__all__))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True", out.stderr


def test_a_command_built_alone_is_the_command_of_the_full_parser():
    """``warmbox X ...`` builds only X's parser (issue 38): each is the same as in the full parser (the
    one the CLI reference is generated from), and --help alone builds none."""
    from warmbox.cli.main import _parser

    full = _parser()
    for name, sub in full.subcommands.items():
        built = _parser([name, "--help"]).subcommands
        assert set(built) == {name}, name  # the others are not even listed: nothing shows them
        assert built[name].format_help() == sub.format_help(), name
    bare = _parser(["--help"])
    assert set(bare.subcommands) == set(full.subcommands)
    assert bare.format_help() == full.format_help()
    assert all(not p._actions[1:] for p in bare.subcommands.values())  # -h only: nothing built


def test_the_in_process_path_loads_no_http_client():
    """The SDK in process (the CLI's fallback when no server runs) loads aiohttp (~120 ms) only when
    a server is addressed (issue 38)."""
    probe = "import json, sys, warmbox.sdk, warmbox.sdk.transport; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert not {m for m in json.loads(out.stdout) if m.split(".")[0] in ("aiohttp", "yarl", "multidict")}
