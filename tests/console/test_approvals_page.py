"""The approval queue answered from the console in a real browser: a start over a tenant's budget
waits until an admin clicks Approve (it finishes) or Deny (the SDK raises ApprovalDenied); a
sandbox's network ask (on_unknown="ask", no SDK callback) waits until its tenant clicks Allow once
(the request reaches the fake world) or Deny (403, nothing reaches it)."""

from __future__ import annotations

import concurrent.futures
import secrets

import pytest

from tests.console.conftest import Console
from tests.console.test_console import login, shot
from warmbox import Network, Sandbox
from warmbox.errors import ApprovalDenied

pytestmark = [pytest.mark.sandbox, pytest.mark.console]

ANSWER_S = 120  # bound on a start or request once its question is answered


def pending(page, **attrs: str):
    sel = "".join(f'[data-{k.replace("_", "-")}="{v}"]' for k, v in attrs.items())
    return page.locator(f"table#approvals-pending tr{sel}")


def closed(page, approval_id: str):
    return page.locator(f'table#approvals-closed tr[data-approval-id="{approval_id}"]')


@pytest.fixture
def queue_page(browser, console: Console):
    """The admin's approvals page."""
    page = login(browser, console, "ops")
    page.goto(console.url + "/ui/approvals")
    try:
        yield page
    finally:
        page.context.close()


def _create_over_budget(console: Console):
    return Sandbox.create(tier="container", timeout=120, **console.sdk("spender"))


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_a_start_over_budget_waits_for_the_operator(queue_page, console: Console, decision: str):
    page = queue_page
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = pool.submit(_create_over_budget, console)
        row = pending(page, kind="create", tenant="spender")
        row.wait_for(state="visible")  # the page's own refresh brings it
        approval_id = row.get_attribute("data-approval-id") or ""
        assert not start.done(), "the start did not wait for an answer"
        assert "budget" in row.locator("td.reason").inner_text()
        if decision == "approve":
            shot(page, "approvals")
        row.locator(f'button[data-decision="{decision}"]').click()
        if decision == "approve":
            with start.result(timeout=ANSWER_S) as sb:
                assert sb.commands.run(["echo", "approved"]).stdout == "approved\n"
        else:
            with pytest.raises(ApprovalDenied) as e:
                start.result(timeout=ANSWER_S)
            assert e.value.state == "denied"
    state = "approved" if decision == "approve" else "denied"
    done = closed(page, approval_id)
    done.wait_for(state="visible")
    assert (done.get_attribute("data-state"), done.get_attribute("data-decision")) == (state, decision)
    assert pending(page, approval_id=approval_id).count() == 0
    if decision == "deny":
        shot(page, "approvals-answered")


CURL = "curl -sS -o /dev/null -w '%{http_code}' --max-time 90 "


@pytest.fixture(scope="module")
def asking(console: Console):
    """An acme sandbox whose unknown destinations are asked about (no SDK callback: the queue)."""
    with Sandbox.create(tier="container", timeout=300, network=Network(on_unknown="ask"), **console.sdk("acme")) as sb:
        yield sb


@pytest.mark.parametrize(
    ("host", "decision", "code"), [("allowed.test", "allow_once", "200"), ("api.test", "deny", "403")]
)
def test_a_network_ask_is_answered_from_the_page(browser, console: Console, world, asking, host, decision, code):
    token = secrets.token_hex(4)  # which request of the fake world's log is this test's
    page = login(browser, console, "acme")  # a tenant answers its own sandboxes' network questions
    try:
        page.goto(console.url + "/ui/approvals")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(
                asking.commands.run, ["/bin/sh", "-c", f"{CURL} http://{host}/hello.txt?t={token}"], timeout=100
            )
            row = pending(page, kind="network", sandbox_id=asking.sandbox_id)
            row.wait_for(state="visible")
            assert row.locator("td.subject").inner_text().startswith(f"{host}:80")
            assert not request.done()
            if decision == "allow_once":
                shot(page, "approvals-network")
            row.locator(f'button[data-decision="{decision}"]').click()
            assert request.result(timeout=ANSWER_S).stdout.strip() == code
        reached = [r for r in world.log("allowed") if r["path"].endswith(f"t={token}")]
        assert len(reached) == (1 if decision == "allow_once" else 0), reached
        assert asking.network.log()  # the attempt is in the sandbox's audit log either way
    finally:
        page.context.close()
