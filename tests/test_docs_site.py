"""The documentation site: built with ``mkdocs build --strict`` (as scripts/lint does), served on
loopback, and a few pages opened in Debian's chromium (Playwright): each has its title, the nav, and
what it is for (a code block, the API reference from docstrings, the CLI's help, the OpenAPI routes),
and the browser asks nothing of any other address (no web fonts or scripts from a CDN)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import ROOT
from warmbox.templates.builtins import CHROMIUM

MKDOCS = Path(sys.executable).with_name("mkdocs")
NAV = ["Getting started", "Tiers", "Warm pools", "Snapshots", "Network egress", "Python API", "HTTP API", "CLI"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built site, served by a thread of this process on 127.0.0.1 (any free port): its URL."""
    out = tmp_path_factory.mktemp("site")
    assert MKDOCS.exists(), f"{MKDOCS} is missing: the docs extra (scripts/bootstrap install) installs it"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        # never --quiet: under it mkdocs 1.6 does not count warnings, and --strict passes a broken link
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def page(site: str) -> Iterator[tuple[object, list[str]]]:
    """One chromium page (headless, Debian's binary) and the list of requests it made off loopback,
    which are refused: the site must render from its own files."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            pg = browser.new_page()
            foreign: list[str] = []

            def route(r: object) -> None:
                url = r.request.url  # type: ignore[attr-defined]
                if urlsplit(url).hostname == "127.0.0.1" or url.startswith(("data:", "blob:")):
                    r.continue_()  # type: ignore[attr-defined]
                else:
                    foreign.append(url)
                    r.abort()  # type: ignore[attr-defined]

            pg.route("**/*", route)
            yield pg, foreign
        finally:
            browser.close()


def _open(page: tuple[object, list[str]], url: str) -> object:
    pg, _ = page
    resp = pg.goto(url, wait_until="load")  # type: ignore[attr-defined]
    assert resp is not None and resp.status == 200, url
    return pg


@pytest.mark.parametrize(
    ("path", "title", "expect"),
    [
        ("", "warmbox", "scripts/bootstrap demo"),
        ("getting-started/", "Getting started", "Sandbox.create("),
        ("reference/cli/", "CLI", "usage: warmbox serve"),
    ],
)
def test_pages_render_with_title_nav_and_code(
    site: str, page: tuple[object, list[str]], path: str, title: str, expect: str
) -> None:
    pg = _open(page, f"{site}/{path}")
    assert pg.title().startswith(title), pg.title()  # type: ignore[attr-defined]
    nav = pg.locator("nav.md-nav--primary").inner_text()  # type: ignore[attr-defined]
    missing = [n for n in NAV if n not in nav]
    assert not missing, f"nav of /{path} lacks {missing}"
    code = pg.locator("pre code").all_inner_texts()  # type: ignore[attr-defined]
    assert any(expect in c for c in code), f"/{path}: no code block with {expect!r}"
    assert pg.locator("pre code").first.is_visible()  # type: ignore[attr-defined]
    assert not page[1], f"the page asked other hosts: {page[1]}"


def test_http_api_page_lists_every_route_of_the_openapi_document(site: str, page: tuple[object, list[str]]) -> None:
    pg = _open(page, f"{site}/reference/http/")
    assert pg.title().startswith("HTTP API")  # type: ignore[attr-defined]
    text = pg.locator("article").text_content() or ""  # type: ignore[attr-defined]
    doc = json.loads((ROOT / "docs" / "openapi.json").read_text())
    routes = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops]
    missing = [r for r in routes if r not in text]
    assert not missing, f"routes of docs/openapi.json missing from the page: {missing[:5]}"
    assert not page[1], f"the page asked other hosts: {page[1]}"


def test_python_api_page_is_generated_from_docstrings(site: str, page: tuple[object, list[str]]) -> None:
    pg = _open(page, f"{site}/reference/python/")
    headings = pg.locator("h2.doc-heading").all_inner_texts()  # type: ignore[attr-defined]
    assert any("AsyncSandbox" in h for h in headings), headings[:10]
    # a docstring's text, as written in the source
    import warmbox.sdk.sandbox as sandbox

    first = (sandbox.AsyncSandbox.__doc__ or "").strip().splitlines()[0].split(":meth:")[0].strip()
    assert first and first in pg.locator("article").inner_text()  # type: ignore[attr-defined]
    assert not page[1], f"the page asked other hosts: {page[1]}"


def test_mcp_page_lists_every_tool_and_its_arguments(site: str, page: tuple[object, list[str]]) -> None:
    from warmbox.server.mcp import build_mcp

    # (in a thread: Playwright's sync API keeps an event loop running in this one)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        tools = pool.submit(asyncio.run, build_mcp(lambda ctx: None).list_tools()).result(60)
    pg = _open(page, f"{site}/reference/mcp/")
    headings = pg.locator("article h2").all_inner_texts()  # type: ignore[attr-defined]
    assert sorted(h.strip().rstrip("¶") for h in headings) == sorted(t.name for t in tools)  # (¶: the permalink)
    cells = set(pg.locator("article td:first-child code").all_inner_texts())  # type: ignore[attr-defined]
    missing = [(t.name, a) for t in tools for a in t.input_schema.get("properties", {}) if a not in cells]
    assert not missing, f"arguments missing from the MCP page: {missing}"


def test_config_page_gives_each_key_its_meaning(site: str, page: tuple[object, list[str]]) -> None:
    """What made a user read the source (issue 34): which warmbox.toml key does what, e.g. upstream_ca."""
    pg = _open(page, f"{site}/reference/config/")
    tables = pg.evaluate(  # type: ignore[attr-defined]
        """() => [...document.querySelectorAll('article table')].map(t => {
            let e = t.closest('.md-typeset__scrollwrap') || t;
            while (e && e.tagName !== 'H2') e = e.previousElementSibling;
            return [e ? e.querySelector('code').textContent : '',
                    [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.textContent.trim()))];
        })"""
    )
    rows = {(section, cells[0]): cells[2] for section, body in tables for cells in body}
    assert "system store" in rows.get(("[network]", "upstream_ca"), ""), sorted(rows)[:20]
    assert "every linked sandbox trusts" in rows[("[network]", "extra_ca")]
    assert ("[server]", "tls_client_ca") in rows and ("[pools.NAME]", "idle_shrink") in rows


def test_readme_is_short_set_up_first_and_its_links_resolve() -> None:
    """The README stays a front page (issue 34): the set-up commands first, the rest on the site."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120, "the README grew: move the new section into docs/ (mkdocs.yml's nav)"
    first = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first] == [["scripts/bootstrap", "demo"], ["scripts/bootstrap", "test"]]
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and not [link for link in links if not (ROOT / link).exists()]
