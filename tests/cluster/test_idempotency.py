"""Idempotency keys through the cluster's router: a keyed create replayed (placement may pick
another node; the key lives in the shared registry) returns the same sandbox, and a keyed command
replayed through the router runs once."""

from __future__ import annotations

import secrets

import pytest

from tests.cluster.conftest import live_ids, sdk
from tests.cluster.harness import Cluster
from warmbox import Sandbox
from warmbox.errors import IdempotencyConflict

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def test_a_keyed_create_and_command_replayed_through_the_router_run_once(cluster: Cluster):
    key = f"step-{secrets.token_hex(4)}"
    before = set(live_ids(cluster))
    sb = Sandbox.create(tier="container", timeout=120, pool=False, idempotency_key=key, **sdk(cluster))
    replays: list[Sandbox] = []
    try:
        for _ in range(3):  # each may be placed on another node: the shared registry has the key
            replays.append(
                Sandbox.create(tier="container", timeout=120, pool=False, idempotency_key=key, **sdk(cluster))
            )
            assert replays[-1].sandbox_id == sb.sandbox_id
        again = replays[-1]
        assert set(live_ids(cluster)) - before == {sb.sandbox_id}
        cmd = "echo $$ >> /workspace/runs; echo runs=$(wc -l < /workspace/runs)"
        first = sb.commands.run(cmd, idempotency_key=key)
        assert again.commands.run(cmd, idempotency_key=key) == first and first.stdout == "runs=1\n"
        with pytest.raises(IdempotencyConflict):
            sb.commands.run("echo other", idempotency_key=key)
        assert sb.commands.run("wc -l < /workspace/runs").stdout == "1\n"
    finally:
        for r in replays:
            r.close()
        sb.kill()
