"""Hostile text in the console, seen by an admin's real browser: a tenant's metadata and the command
text its sandbox ran carry markup; the list and the sandbox page show it as text, nothing of it
becomes an element or runs, and the Content-Security-Policy is never the thing that stopped it
(a CSP violation would mean the markup reached the DOM unescaped)."""

from __future__ import annotations

import pytest

from tests.console.conftest import Console
from tests.console.test_console import login, row, shot
from warmbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.console]

# each would set window.__xss (or open a dialog) if it ever became markup; "x-injected" marks elements
PAYLOADS = (
    '<img src=x class="x-injected" onerror="window.__xss=1">',
    '"><script class="x-injected">window.__xss=2</script>',
    "<svg class='x-injected' onload=alert(3)></svg>",
    "</code></dd></dl><iframe class=x-injected srcdoc='<script>parent.__xss=4</script>'></iframe>",
)


def watch(page) -> list[str]:
    """What went wrong in ``page`` from now on: dialogs, CSP violations, uncaught errors."""
    seen: list[str] = []

    def on_dialog(d) -> None:
        seen.append(f"dialog: {d.message}")
        d.dismiss()

    page.on("dialog", on_dialog)
    page.on("pageerror", lambda e: seen.append(f"error: {e}"))
    page.on(
        "console",
        lambda m: seen.append(f"console: {m.text}") if "Content Security Policy" in m.text else None,
    )
    return seen


def assert_inert(page, seen: list[str]) -> None:
    assert page.locator(".x-injected").count() == 0, "hostile markup became elements"
    assert page.evaluate("window.__xss === undefined")
    assert not seen, seen


def test_hostile_text_stays_text(browser, console: Console):
    metadata = {f"k{i}": p for i, p in enumerate(PAYLOADS)} | {PAYLOADS[0][:60]: "key with markup"}
    with Sandbox.create(tier="container", timeout=120, metadata=metadata, **console.sdk("acme")) as sb:
        sb.commands.run(["/bin/echo", *PAYLOADS])
        page = login(browser, console, "ops")
        try:
            seen = watch(page)
            r = row(page, sb.sandbox_id)
            r.wait_for(state="visible")
            # one refresh more: what the list's script swaps in must be as inert as the first render
            refreshed = page.locator("#sandbox-rows").get_attribute("data-refreshed-at")
            page.wait_for_function(
                "v => document.querySelector('#sandbox-rows').getAttribute('data-refreshed-at') !== v",
                arg=refreshed,
            )
            assert_inert(page, seen)

            resp = page.goto(f"{console.url}/ui/sandboxes/{sb.sandbox_id}")
            assert resp is not None and resp.status == 200
            csp = resp.headers.get("content-security-policy", "")
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp, csp
            meta = page.locator('#sandbox-info dd[data-field="metadata"]')
            text = meta.inner_text()
            for p in PAYLOADS:
                assert p in text, f"not shown literally: {p!r}"
            # the command's text (its argv, shell-quoted by the records) is in the commands table as text
            cmd = page.locator('#commands tr[data-kind="command"] td.command').first
            cmd.wait_for(state="visible")
            assert all(p in cmd.inner_text() for p in ("<img src=x", "<script class=", "<svg class=", "<iframe")), (
                cmd.inner_text()
            )
            page.wait_for_function(  # the live region's refresh too
                "() => document.querySelector('#sandbox-live').hasAttribute('data-refreshed-at')"
            )
            assert_inert(page, seen)
            shot(page, "sandbox-hostile")
        finally:
            page.context.close()
