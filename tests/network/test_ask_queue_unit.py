"""The proxy's questions without a sandbox: the webhooks told of a queued question, and the bound on
open questions (a real Proxy object and registry; the webhook is a server on loopback)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from warmbox import config
from warmbox.network import asks
from warmbox.network.proxy import ASK_OPEN_PER_SANDBOX, ASK_OPEN_PER_TENANT, Proxy
from warmbox.storage.registry import Registry


@pytest.fixture
def hook():
    """A webhook on loopback: replies ``reply[0]``, records every body it was POSTed."""
    got: list[dict] = []
    reply = [b"{}"]

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply[0])))
            self.end_headers()
            self.wfile.write(reply[0])

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/", got, reply
    srv.shutdown()
    srv.server_close()
    t.join(5)


def run_proxy(home, toml: str, body) -> None:
    """Run ``body(proxy)`` (a coroutine function) on a Proxy of ``home`` configured by ``toml``."""
    home.mkdir(exist_ok=True)
    (home / "warmbox.toml").write_text(toml)

    async def main() -> None:
        proxy = Proxy(home, config.load(home))
        proxy.watch = asks.AnswerWatch(home / "registry.db", asyncio.get_running_loop())
        try:
            await body(proxy)
        finally:
            proxy.watch.stop()

    asyncio.run(main())


def test_the_network_webhook_answers_a_queued_question(tmp_path, hook):
    url, got, reply = hook
    reply[0] = b'{"decision": "allow_once"}'

    async def body(proxy: Proxy) -> None:
        assert await proxy.ask("sb-1", "x.test", 443, "connect") == (True, "approval:allow_once", "")
        [row] = proxy.registry.approvals.approvals(None)
        assert (row.kind, row.subject, row.sandbox_id, row.state) == ("network", "x.test:443", "sb-1", "approved")
        assert (row.decision, row.answered_by) == ("allow_once", "webhook")
        # its old body, with the question's id (to answer later through the API instead)
        assert got == [
            {"approval_id": row.approval_id, "sandbox_id": "sb-1", "host": "x.test", "port": 443, "kind": "connect"}
        ]

    run_proxy(tmp_path / "home", f'[network]\napproval_webhook = "{url}"\napproval_timeout = 5\n', body)


def test_a_webhook_without_a_decision_leaves_the_question_to_the_queue(tmp_path, hook):
    url, got, _ = hook  # replies {}: no decision

    async def body(proxy: Proxy) -> None:
        asking = asyncio.ensure_future(proxy.ask("sb-1", "2001:db8::7", 80, "http"))
        while not got:
            await asyncio.sleep(0.02)
        # the queue's webhook is sent the question itself, as for every other kind
        assert (got[0]["kind"], got[0]["subject"], got[0]["state"]) == ("network", "[2001:db8::7]:80", "pending")
        await asyncio.sleep(0.2)
        assert not asking.done()
        Registry(proxy.home / "registry.db").approvals.answer_approval(got[0]["approval_id"], "deny", "root")
        proxy.watch.nudge()  # what the engine's answer does over the control socket
        assert await asyncio.wait_for(asking, 10) == (False, "approval:deny", "")

    run_proxy(tmp_path / "home", f'[approvals]\nwebhook = "{url}"\n[network]\napproval_timeout = 5\n', body)


def test_open_questions_are_bounded_per_sandbox_and_shared_per_destination(tmp_path):
    async def body(proxy: Proxy) -> None:
        held = [asyncio.ensure_future(proxy.ask("sb-1", f"h{i}.test", 80, "http")) for i in range(ASK_OPEN_PER_SANDBOX)]
        await asyncio.sleep(0.1)
        ok, rule, detail = await proxy.ask("sb-1", "one-more.test", 80, "http")
        assert (ok, rule) == (False, "approval:queue-full") and f"at most {ASK_OPEN_PER_SANDBOX}" in detail
        # a second connection to an open question joins it; another sandbox has its own bound
        again = asyncio.ensure_future(proxy.ask("sb-1", "h0.test", 80, "http"))
        other = asyncio.ensure_future(proxy.ask("sb-2", "one-more.test", 80, "http"))
        await asyncio.sleep(0.1)
        assert not again.done() and not other.done()
        open_rows = proxy.registry.approvals.approvals(None, pending_only=True)
        assert sorted(a.subject for a in open_rows) == sorted(
            [f"h{i}.test:80" for i in range(ASK_OPEN_PER_SANDBOX)] + ["one-more.test:80"]
        )
        [h0] = [a for a in open_rows if a.subject == "h0.test:80"]
        Registry(proxy.home / "registry.db").approvals.answer_approval(h0.approval_id, "allow_once", "root")
        proxy.watch.nudge()
        assert await asyncio.wait_for(held[0], 10) == (True, "approval:allow_once", "")
        assert await asyncio.wait_for(again, 10) == (True, "approval:allow_once", "")
        for t in [*held[1:], other]:
            t.cancel()

    run_proxy(tmp_path / "home", "[network]\napproval_timeout = 30\n", body)


def test_a_late_sdk_callback_answers_a_question_waiting_in_the_queue(tmp_path):
    from warmbox.engine import egress
    from warmbox.network.supervisor import control_path

    asked: list[str] = []

    def hook(req):
        asked.append(f"{req.host}:{req.port}:{req.kind}")
        return "allow_always"

    async def body(proxy: Proxy) -> None:
        server = await asyncio.start_unix_server(proxy.serve_control, path=str(control_path(proxy.home)))
        asking = asyncio.ensure_future(proxy.ask("sb-1", "late.test", 80, "http"))
        await asyncio.sleep(0.1)
        [row] = proxy.registry.approvals.approvals(None, pending_only=True)  # nobody subscribed: queued
        subscribed = asyncio.Event()
        sub = asyncio.ensure_future(egress.approvals(proxy.home, "sb-1", hook, subscribed))
        try:
            assert await asyncio.wait_for(asking, 10) == (True, "approval:allow_always", "")
            assert asked == ["late.test:80:http"]
            done = proxy.registry.approvals.approval(row.approval_id)
            assert (done.state, done.decision, done.answered_by) == ("approved", "allow_always", "sdk callback")
        finally:
            sub.cancel()
            server.close()

    run_proxy(tmp_path / "home", "[network]\napproval_timeout = 30\n", body)


def test_one_tenants_many_sandboxes_are_bounded_together(tmp_path):
    async def body(proxy: Proxy) -> None:
        per = ASK_OPEN_PER_SANDBOX
        n = ASK_OPEN_PER_TENANT // per  # sandboxes of one tenant (the host's here) that fill its bound
        held = [
            asyncio.ensure_future(proxy.ask(f"sb-{s}", f"h{i}.test", 80, "http")) for s in range(n) for i in range(per)
        ]
        await asyncio.sleep(0.2)
        assert len(proxy.registry.approvals.approvals(None, pending_only=True, limit=1000)) == ASK_OPEN_PER_TENANT
        ok, rule, detail = await proxy.ask(f"sb-{n}", "h0.test", 80, "http")  # a fresh sandbox, same tenant
        assert (ok, rule) == (False, "approval:queue-full") and f"at most {ASK_OPEN_PER_TENANT}" in detail
        for t in held:
            t.cancel()

    run_proxy(tmp_path / "home", "[network]\napproval_timeout = 30\n", body)
