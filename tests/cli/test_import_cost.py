"""What ``import warmbox`` and ``warmbox --help`` load, pinned (issue 38): neither imports the HTTP
client, the SDK, the engine or asyncio, so the command line's start cannot grow back silently. A
module added here on purpose is a line in one of the sets below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HELP_MODULES = {
    "warmbox",
    "warmbox.cli",
    "warmbox.cli.approvals",
    "warmbox.cli.cluster",
    "warmbox.cli.context",
    "warmbox.cli.db",
    "warmbox.cli.keys",
    "warmbox.cli.templates",
    "warmbox.cli.volumes",
    "warmbox.errors",
    "warmbox.models",
    "warmbox.network",
    "warmbox.network.policy",
    "warmbox.operations",
    "warmbox.templates",
    "warmbox.templates.dockerfile",
    "warmbox.templates.keys",
    "warmbox.templates.spec",
}
NEVER = {"aiohttp", "asyncio", "ssl", "rich", "warmbox.sdk", "warmbox.engine", "warmbox.server", "warmbox.backends"}

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
print(json.dumps(sorted(sys.modules)))
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


def test_public_names_still_resolve():
    """The lazy re-exports of warmbox/__init__.py: every name of __all__ is there on first use."""
    out = subprocess.run(
        [sys.executable, "-c", "import warmbox; print(all(getattr(warmbox, n) is not None for n in warmbox.__all__))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True", out.stderr
