"""A microVM warm pool: filled with restores of the shape's template, claimed once.

Its own module so that no other VM of the test session runs while the pool holds one VM and a
claim adds a second (its refill then makes at most two as well): never more than two at once.
"""

from __future__ import annotations

import pytest

from tests.backends.conftest import qemu_pids as _qemu_pids
from warmbox import Limits, Sandbox

pytestmark = pytest.mark.sandbox

LIMITS = Limits(memory_mb=256, pids=64, tmp_mb=64)


def test_a_microvm_pool_hands_out_restored_sandboxes(engine, home):
    from tests.conftest import set_config, wait_for

    set_config(
        home,
        f"""
[pools.t-vm]
tier = "microvm"
template = "base"
min = 1
max = 1
target = 1
limits = {{ memory_mb = {LIMITS.memory_mb}, pids = {LIMITS.pids}, tmp_mb = {LIMITS.tmp_mb} }}
""",
    )
    try:
        engine.ensure_daemon()
        wait_for(lambda: engine.registry.pools.pool_counts("t-vm")[0] >= 1, 120, "the microvm pool to fill")
        sid = engine.registry.pools.pooled("t-vm")[0]
        assert [t.reason for t in engine.registry.sandboxes.transitions(sid)][-1].startswith("restored from snap-")
        with Sandbox.create(tier="microvm", limits=LIMITS, envs={"WHO": "me"}) as sb:
            assert sb.from_pool and sb.sandbox_id == sid
            assert sb.commands.run("echo $WHO").stdout == "me\n"
            assert sb.run_code("import os; os.environ['WHO']").text == "'me'"
    finally:
        set_config(home)
    wait_for(lambda: not engine.registry.pools.pooled("t-vm"), 60, "the microvm pool to be retired")
    wait_for(lambda: not _qemu_pids(engine.runtime), 60, "the refill's VM (if one started) to be destroyed")
