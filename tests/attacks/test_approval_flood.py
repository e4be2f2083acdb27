"""A tenant cannot flood the approval queue with cost questions (through a real `warmbox serve`).

Red-team finding: nothing bounded a tenant's open create/resume questions. A tenant over its
budget fired creates at will, each one a pending question (and a held request polling the
registry); the operator's queue shows the newest 1000, so a flood of them pushed another
tenant's older question off the page, where it timed out: ApprovalDenied for the victim, with no
operator ever seeing it. Now at most engine.approvals.MAX_OPEN_PER_TENANT of one tenant's cost
questions wait; past that a create is refused at once (ApprovalDenied, "too many questions waiting").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.attacks.test_approval_queue import _http
from tests.conftest import start_server
from warmbox.engine.approvals import MAX_OPEN_PER_TENANT
from warmbox.engine.engine import Engine

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

FLOOD = MAX_OPEN_PER_TENANT + 8


def test_a_tenant_cannot_bury_the_queue_in_its_own_questions(home: Path, runc_ready: None):
    registry = Engine.for_home(home).registry
    stamp = time.time_ns() % 10**9
    _, evil = registry.tenants.create_key(f"flood-evil{stamp}", budget_cpu_h=0.001)  # any start goes past it
    _, victim = registry.tenants.create_key(f"flood-victim{stamp}", budget_cpu_h=0.001)
    _, admin = registry.tenants.create_key(f"flood-ops{stamp}", admin=True)
    srv = start_server(home, home / "flood.sock", env={"WARMBOX_APPROVALS__TIMEOUT": "60"})
    body = {"limits": {"memory_mb": 256, "cpus": 1}, "pool": False}
    answers: list[tuple[int, object]] = []

    def create(key: str) -> None:
        answers.append(_http(srv.url, "POST", "/v1/sandboxes", key, body))

    threads = [threading.Thread(target=create, args=(victim,))]
    threads += [threading.Thread(target=create, args=(evil,)) for _ in range(FLOOD)]
    try:
        threads[0].start()
        deadline = time.monotonic() + 30
        while not _http(srv.url, "GET", "/v1/approvals?pending_only=true", victim)[1]:
            assert time.monotonic() < deadline, "the victim's create asked no question"
            time.sleep(0.05)
        for t in threads[1:]:
            t.start()
        while len(answers) < FLOOD - MAX_OPEN_PER_TENANT:  # the refused ones answer at once
            assert time.monotonic() < deadline, f"only {len(answers)} creates were refused"
            time.sleep(0.05)
        status, mine = _http(srv.url, "GET", "/v1/approvals?pending_only=true", evil)
        assert status == 200 and len(mine) == MAX_OPEN_PER_TENANT  # type: ignore[arg-type]
        for status, err in answers:
            assert status == 403 and err["error"]["code"] == "approval_denied"  # type: ignore[index]
            assert "already wait" in err["error"]["message"]  # type: ignore[index]
        # the operator still sees the victim's question among everyone's
        status, everyone = _http(srv.url, "GET", "/v1/approvals?pending_only=true", admin)
        assert status == 200 and len(everyone) == MAX_OPEN_PER_TENANT + 1  # type: ignore[arg-type]
        for q in everyone:  # type: ignore[union-attr]
            assert _http(srv.url, "POST", f"/v1/approvals/{q['approval_id']}", admin, {"decision": "deny"})[0] == 200
        for t in threads:
            t.join(30)
        assert len(answers) == FLOOD + 1
        assert all(status == 403 for status, _ in answers)
    finally:
        srv.stop()
        for t in threads:
            t.join(10)
