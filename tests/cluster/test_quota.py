"""A tenant's quota is cluster-wide: 4 client processes creating at once through the router (which
places them on 3 nodes) never get more than the tenant's max_sandboxes, and every refusal is typed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.cluster.conftest import live_ids, sdk
from tests.cluster.harness import Cluster
from warmbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]

LIMIT = 3
CLIENTS = 4
EACH = 2  # creates per client: 8 asked at once for 3 allowed

CLIENT = r"""
import json, sys, time
from warmbox import QuotaExceeded, Sandbox
url, key, start_at, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
time.sleep(max(0.0, start_at - time.time()))  # every client starts at the same instant
out = []
for _ in range(n):
    try:
        sb = Sandbox.create(timeout=120, api_url=url, api_key=key)
        out.append(["ok", sb.sandbox_id])
        sb.close()  # let go of it, it keeps running (and counting)
    except QuotaExceeded as e:
        out.append(["quota", str(e)])
    except Exception as e:
        out.append(["error", type(e).__name__ + ": " + str(e)])
print(json.dumps(out))
"""


def test_four_concurrent_clients_never_exceed_the_tenant_s_cluster_wide_quota(cluster: Cluster):
    _key_id, secret = cluster.registry().tenants.create_key("quota4", max_sandboxes=LIMIT)
    url = cluster.client_env["WARMBOX_API_URL"]
    start_at = time.time() + 3.0  # after the 4 interpreters have imported warmbox
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, url, secret, str(start_at), str(EACH)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(CLIENTS)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            results += json.loads(out)
        made = [sid for what, sid in results if what == "ok"]
        errors = [msg for what, msg in results if what == "error"]
        assert not errors, errors
        assert len(made) == LIMIT, f"{len(made)} created for a quota of {LIMIT}: {results}"
        assert sorted(live_ids(cluster, tenant="quota4")) == sorted(made)
        nodes = {cluster.node_of(sid) for sid in made}
        assert nodes <= set(cluster.nodes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for sid in live_ids(cluster, tenant="quota4"):
            Sandbox.connect(sid, **sdk(cluster, secret)).kill()
