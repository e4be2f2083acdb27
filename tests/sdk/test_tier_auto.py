"""Sandbox.create(tier="auto", requirements=...): the tier the four questions choose on this host, with
the choice and its reasons kept in get_info() — in process and over HTTP."""

from __future__ import annotations

import pytest

from tests.cli.test_advise import profiled  # noqa: F401 - the fixture: a measured profile in the home
from warmbox import InvalidArgument, NoSuitableTier, Requirements, Sandbox


@pytest.mark.sandbox
@pytest.mark.one_host("the tier profile it measures is in the session home; the cluster's nodes choose by their own")
def test_auto_puts_untrusted_compute_on_gvisor_and_says_why(profiled, runc_ready):  # noqa: F811
    req = Requirements("python", trusted=False, io="compute")
    sb = Sandbox.create(tier="auto", requirements=req, template="shell", timeout=120, pool=False)
    try:
        assert sb.tier == "gvisor"
        info = sb.get_info()
        assert (info.tier, info.requirements) == ("gvisor", req)
        assert any("compute work runs at ~1.0x the host's time here (measured" in r for r in info.tier_reasons)
        assert "too weak for untrusted code" in info.tier_rejected["container"]
        assert "slower for compute work: ~21.0x" in info.tier_rejected["microvm"]
        assert sb.commands.run("echo $((6*7))").stdout == "42\n"
        sb.pause()  # the record stays with the sandbox's id
        back = Sandbox.connect(sb.sandbox_id)
        assert back.get_info().tier_reasons == info.tier_reasons
        back.kill()
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_auto_refuses_what_no_tier_here_fits_and_explicit_tiers_record_nothing(profiled, runc_ready):  # noqa: F811
    with pytest.raises(NoSuitableTier) as e:  # no tier runs wasm on a guest kernel of its own
        Sandbox.create(tier="auto", requirements=Requirements("wasm", guest_kernel=True), timeout=60)
    assert "microvm: does not run wasm (runs python, javascript, bash, c)" in e.value.rejected
    assert sorted(line.split(":")[0] for line in e.value.rejected) == ["container", "gvisor", "isolate", "microvm"]
    with pytest.raises(InvalidArgument, match='pass tier="auto"'):
        Sandbox.create(tier="container", requirements=Requirements("python"), timeout=60)
    sb = Sandbox.create(template="shell", timeout=60)
    try:
        info = sb.get_info()
        assert (info.requirements, info.tier_reasons, info.tier_rejected) == (None, (), {})
    finally:
        sb.kill()
