"""Attack tests: each runs one attack from a hostile sandbox user against a real sandbox.

This folder is the list of what warmbox withstands; ``warmbox doctor --security`` names the
test that proves each guarantee. Tests are parametrised over the tiers an attack applies to.
"""

from __future__ import annotations

import pytest

from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox


def require_tier(home, tier: str) -> Engine:
    """The engine of the session home; the tier must run here (bootstrap installs every tier)."""
    engine = Engine.for_home(home)
    avail = engine.backend(tier).probe()
    if not avail.available:
        pytest.fail(f"the {tier} tier must run here (scripts/bootstrap installs it): {avail.reason}")
    return engine


@pytest.fixture(params=["container", "gvisor"])
def tier(request, home, runc_ready) -> str:
    """The shared-filesystem tiers (microVM attacks live in their own modules: at most two VMs)."""
    require_tier(home, request.param)
    return request.param
