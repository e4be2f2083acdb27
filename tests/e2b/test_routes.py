"""Every route and RPC the installed E2B SDKs call is in the adapter's table (served, or answered
with a typed "not supported" error), and docs/e2b.md shows the table as it is. Derived from the
SDKs' installed sources: the control-plane modules their Sandbox classes import (each one's
method and URL), the envd services' generated endpoints, the code interpreter's requests."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

from warmbox.server.e2b import table

e2b = pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")
import e2b_code_interpreter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SANDBOX_MODULES = (
    "e2b.sandbox_sync.main",
    "e2b.sandbox_sync.sandbox_api",
    "e2b.sandbox_sync.paginator",
    "e2b.sandbox_async.main",
    "e2b.sandbox_async.sandbox_api",
    "e2b.sandbox_async.paginator",
)


def _api_routes() -> set[tuple[str, str]]:
    """(METHOD, path) of every control-plane call the SDK's Sandbox classes make (the generated
    modules of its sandboxes, snapshots and templates APIs they import: delete_snapshot is a
    template delete)."""
    used: set[str] = set()
    for name in _SANDBOX_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        imports = r"from e2b\.api\.client\.api\.(sandboxes|snapshots|templates) import "
        for api, block in re.findall(imports + r"\(?([^)]*?)\)?\n(?!\s)", source, re.S):
            used.update(f"{api}.{m}" for m in re.findall(r"\w+", block))
        used.update(".".join(m) for m in re.findall(imports + r"(\w+)$", source, re.M))
    assert used, "no generated control-plane module found in the SDK's Sandbox sources"
    assert "snapshots.get_snapshots" in used and "templates.delete_templates_template_id" in used, used
    routes = set()
    for mod in sorted(used):
        src = inspect.getsource(importlib.import_module(f"e2b.api.client.api.{mod}"))
        method = re.search(r'"method": "(\w+)"', src)
        url = re.search(r'"url": f?"([^"]+)"', src)
        assert method and url, mod
        routes.add((method.group(1).upper(), re.sub(r"\{\w+\}", "{id}", url.group(1))))
    return routes


def _rpc_routes() -> set[tuple[str, str]]:
    routes = set()
    for name in ("e2b.envd.process.process_connect", "e2b.envd.filesystem.filesystem_connect"):
        src = inspect.getsource(importlib.import_module(name))
        routes.update(("POST", p) for p in re.findall(r'"(/\w+\.\w+/\w+)": Endpoint', src))
    assert len(routes) >= 15
    return routes


def _envd_http_routes() -> set[tuple[str, str]]:
    from e2b.envd import api

    return {("GET", api.ENVD_API_FILES_ROUTE), ("POST", api.ENVD_API_FILES_ROUTE), ("GET", api.ENVD_API_HEALTH_ROUTE)}


def _interpreter_routes() -> set[tuple[str, str]]:
    src = inspect.getsource(importlib.import_module("e2b_code_interpreter.code_interpreter_sync"))
    routes = set()
    for method, path in re.findall(r'(post|get|delete|"POST")\(?\s*f"\{self\._jupyter_url\}(/[^"]*)"', src, re.S):
        routes.add((method.strip('"').upper(), re.sub(r"\{\w+\}", "{id}", path)))
    for path in re.findall(r'"POST",\s*f"\{self\._jupyter_url\}(/[^"]*)"', src):
        routes.add(("POST", path))
    assert ("POST", "/execute") in routes, routes
    return routes


@pytest.mark.parametrize(
    ("plane", "derive"),
    [("api", _api_routes), ("envd", _rpc_routes), ("envd", _envd_http_routes), ("interpreter", _interpreter_routes)],
)
def test_every_route_the_sdk_calls_is_in_the_table(plane, derive):
    missing = sorted(f"{m} {p}" for m, p in derive() if table.find(plane, m, p) is None)
    assert not missing, f"E2B {plane} routes the installed SDK calls but warmbox's table lacks: {missing}"


def test_the_sdk_versions_are_the_pinned_ones():
    from importlib.metadata import version

    text = (ROOT / "pyproject.toml").read_text()
    for dist in ("e2b", "e2b-code-interpreter"):
        assert f'"{dist}=={version(dist)}"' in text, f"{dist} {version(dist)} is not what pyproject.toml pins"
    assert e2b_code_interpreter  # imported: the code interpreter's routes were read from it


def test_docs_show_the_table():
    doc = (ROOT / "docs" / "e2b.md").read_text()
    assert table.markdown() in doc, "docs/e2b.md's route table differs from warmbox.server.e2b.table (regenerate it)"
