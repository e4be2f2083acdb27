"""Layers point down only: every warmbox import (lazy ones too) goes to the same or a lower layer."""

from __future__ import annotations

import ast
from pathlib import Path

import warmbox

SRC = Path(warmbox.__file__).parent
CORE = {
    "errors",
    "models",
    "protocol",
    "lifecycle",
    "operations",
    "paths",
    "tiers",
    "config",
    "api",
    "wire",
    "apicodec",
    "templates",
    "images",
}
# what each part may import besides itself and core
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "templates": set(),  # core too: the template spec and Dockerfile parser (models, errors, stdlib)
    "guest": set(),  # and of core only protocol and safetar (checked below): it runs inside the sandbox
    "backends": set(),
    "storage": set(),
    "network": {"storage"},
    "engine": {"backends", "network", "storage"},
    "sdk": set(),
    # beside the SDK: adapters (HTTP routes, MCP tools) over the engine front; network: the policy records
    "server": {"engine", "sdk", "network"},
    # a cluster node runs an engine and its API server; the router forwards over the SDK's HTTP transport
    "cluster": {"engine", "sdk", "server", "storage", "network"},
    # the engine: its front, and the daemon/pool managers (pools, down)
    # network: the policy presets in --allow's help, doctor's check of the host's CAs (network/tls.py)
    "cli": {"sdk", "engine", "bench", "server", "cluster", "network"},
    # benchmarks drive raw runtimes as baselines (backends) beside sandboxes made through the SDK;
    # bench cluster reaches a node's API as a cluster peer (server.peer's header names)
    "bench": {"sdk", "engine", "backends", "storage", "cluster", "server"},
}
# the in-process transport is where the SDK meets the engine front (a remote one does not);
# the SDK names the public policy types (warmbox.Network, warmbox.Secret: plain records)
# a template's build network may be given as a warmbox.Network (network/policy.py imports only errors)
# [network.presets] in warmbox.toml are validated as the policy's own rules (config.py)
EXCEPTIONS = {
    ("sdk/transport.py", "engine"),
    ("sdk/network.py", "network"),
    ("templates/spec.py", "network"),
    ("config.py", "network"),
}


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "warmbox" or len(parts) < 2:
        return ""
    return "core" if parts[1] in CORE else parts[1]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("warmbox.")}


def test_layers_point_down_only():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "__init__.py":
            continue  # the package re-exports the public API
        here = "core" if "/" not in rel else rel.split("/")[0]
        for mod in _imports(path):
            there = _part(mod)
            if not there or there == here or (there == "core" and here != "guest"):
                continue
            if here == "guest" and mod in ("warmbox.protocol", "warmbox.safetar"):
                continue
            if there in ALLOWED[here]:
                continue
            if (rel, there) in EXCEPTIONS and (there != "network" or mod.startswith("warmbox.network.policy")):
                continue  # (of network, only its policy records: network/policy.py imports only errors)
            if mod.rsplit(".", 1)[0] in ("warmbox", f"warmbox.{here}"):
                continue  # `from warmbox import x` naming a sibling module is judged by x
            bad.append(f"{rel} imports {mod}")
    assert bad == [], "\n".join(bad)


def test_guest_imports_only_the_protocol():
    for path in (SRC / "guest").rglob("*.py"):
        for mod in _imports(path):
            assert mod.startswith(("warmbox.protocol", "warmbox.safetar", "warmbox.guest")), (
                f"{path.name} imports {mod}"
            )
