"""The cluster tests' helpers. The session fixture ``cluster`` itself lives in tests/conftest.py (the
--api=cluster lane of tests/sdk uses it too); what it starts is in tests/cluster/harness.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.cluster.harness import Cluster


def sdk(cluster: Cluster, secret: str | None = None) -> dict[str, str]:
    """Sandbox.create(**sdk(cluster)): the SDK through the router, as tenant "pytest" (or ``secret``'s)."""
    env = cluster.client_env
    return {"api_url": env["WARMBOX_API_URL"], "api_key": secret or env["WARMBOX_API_KEY"]}


def runc_state(cluster: Cluster, node: str, sandbox_id: str) -> dict | None:
    """runc's state of the sandbox's container on ``node`` (None: no such container there)."""
    path = cluster.nodes[node].runtime / "runc" / sandbox_id / "state.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        return None


def on_node(cluster: Cluster, node: str, sandbox_id: str) -> bool:
    """Whether ``node``'s runtime dir holds the sandbox (its state dir)."""
    return (cluster.nodes[node].runtime / "sandboxes" / sandbox_id).exists()


def process_alive(pid: int, start: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == start and fields[0] not in ("Z", "X")


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def live_ids(cluster: Cluster, tenant: str | None = None) -> list[str]:
    return [info.sandbox_id for info, _h in cluster.registry().sandboxes.list(tenant=tenant)]


@pytest.fixture(scope="module", autouse=True)
def _cluster_hygiene(request: pytest.FixtureRequest):
    """After each module that used the cluster: every node up again (a test may kill or drain one;
    a module's tests may share that state, in file order), and no sandbox left running (its own
    are killed; leaving one fails the module's last test)."""
    yield
    if not any(item.module is request.module and "cluster" in item.fixturenames for item in request.session.items):
        return
    cluster: Cluster = request.getfixturevalue("cluster")
    cluster.ensure_all_up()
    # every test sandbox is made through the router with a key (a tenant); the nodes' own pools' are the host's ("")
    left = [info for info, _h in cluster.registry().sandboxes.list() if info.tenant]
    if left:
        from warmbox import operations as ops
        from warmbox.sdk.http import HttpTransport

        async def kill_all() -> None:
            t = HttpTransport(cluster.client_env["WARMBOX_API_URL"], api_key=cluster.admin_key)
            try:
                for info in left:
                    await t.handle(ops.Kill(info.sandbox_id))
            finally:
                await t.close()

        asyncio.run(kill_all())
        pytest.fail(
            f"the tests left live sandboxes on the cluster: {[(i.sandbox_id, i.tenant, i.state) for i in left]}"
        )
