"""The isolation tiers: canonical names, their aliases, the module of each backend, and the tier selector."""

from __future__ import annotations

from collections.abc import Sequence

from warmbox.errors import InvalidArgument, NoSuitableTier
from warmbox.models import (
    ISOLATION_RANKS,
    UNTRUSTED_MIN_RANK,
    Capabilities,
    HostProfile,
    Requirements,
    TierCandidate,
    TierChoice,
    TierProfile,
    canonical_language,
)

# tier name -> (aliases, backend "module:class"); the backend is imported lazily (backends.load),
# so a tier's optional tools stay optional. A new tier is one row here and one file in backends/.
TIERS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "container": (("container", "runc"), "warmbox.backends.runc:RuncBackend"),
    "gvisor": (("gvisor", "runsc"), "warmbox.backends.gvisor:GvisorBackend"),
    "microvm": (("microvm", "qemu"), "warmbox.backends.microvm:MicroVMBackend"),
    "isolate": (("isolate", "v8", "wasm"), "warmbox.backends.isolate:IsolateBackend"),
}


def canonical_tier(name: object) -> str:
    """The canonical name of a tier or one of its aliases; InvalidArgument naming the known ones."""
    if not isinstance(name, str):
        raise InvalidArgument(f"tier must be a string, got {name!r}")
    for tier, (aliases, _) in TIERS.items():
        if name in aliases:
            return tier
    known = ", ".join(sorted(a for aliases, _ in TIERS.values() for a in aliases))
    raise InvalidArgument(f"unknown tier {name!r} (known: {known})")


# ---- the four questions (tier="auto"): decided from Capabilities, availability and a measured profile

SAME_COST = 1.15  # costs within this factor of each other are a tie (the profile's noise on a busy host)


def _languages(caps: Capabilities) -> tuple[str, ...]:
    out = []
    for name in caps.languages:
        lang = canonical_language(name)
        if lang and lang not in out:
            out.append(lang)
    return tuple(out)


def _unfit(req: Requirements, c: TierCandidate, egress: bool = False, template: str = "", volumes: bool = False) -> str:
    """Why tier ``c`` cannot take code of ``req`` ("" if it can); the first question it fails."""
    caps = c.capabilities
    if caps is None or not c.available:
        return f"not available here: {c.reason}"
    langs = _languages(caps)
    if req.language not in langs:
        return f"does not run {req.language} (runs {', '.join(langs) or 'nothing the selector knows'})"
    if not req.trusted and caps.isolation_rank < UNTRUSTED_MIN_RANK:
        what = ISOLATION_RANKS.get(caps.isolation_rank, "undeclared isolation")
        return (
            f"too weak for untrusted code: {what} (isolation rank {caps.isolation_rank}; untrusted code "
            f"needs {UNTRUSTED_MIN_RANK}+: {ISOLATION_RANKS[UNTRUSTED_MIN_RANK]})"
        )
    if req.guest_kernel and not caps.custom_kernel:
        return "no guest kernel of its own (the code would run on the host's or a user-space kernel)"
    if req.io == "syscall-heavy" and not caps.commands:
        return "runs code only, no processes or files: syscall-heavy work (fork, files) cannot run here"
    if (req.io == "network" or egress) and not any(m != "none" for m in caps.network_modes):
        return f"no egress on this tier (network modes: {', '.join(caps.network_modes) or 'none'})" + (
            "" if req.io == "network" else ", and the sandbox asks for a network policy"
        )
    if template and not caps.images:
        return f"runs no template images, and the sandbox asks for template {template!r}"
    if volumes and not caps.files:
        return "has no filesystem, and the sandbox asks for volumes"
    return ""


def _cost(req: Requirements, caps: Capabilities, measured: TierProfile | None) -> tuple[float, str]:
    """The expected slowdown against the host for ``req.io`` work, and where the figure comes from."""
    if measured is not None:
        value = {"compute": measured.compute, "syscall-heavy": measured.syscall, "network": measured.socket}[req.io]
        return value, (
            f"measured: compute {measured.compute:.1f}x, syscalls {measured.syscall:.1f}x "
            f"(fork {measured.fork:.1f}x, files {measured.files:.1f}x, socket {measured.socket:.1f}x)"
        )
    value = caps.cpu_slowdown if req.io == "compute" else caps.syscall_slowdown
    note = f"; {caps.cost_note}" if caps.cost_note else ""
    return value, f"declared: compute {caps.cpu_slowdown:g}x, syscalls {caps.syscall_slowdown:g}x{note}"


def choose(
    req: Requirements,
    candidates: Sequence[TierCandidate],
    profile: HostProfile | None = None,
    profile_note: str = "",
    *,
    egress: bool = False,
    template: str = "",
    volumes: bool = False,
) -> TierChoice:
    """The tier for code of ``req`` among ``candidates`` (every tier, with this host's availability).

    Hard questions first: a tier is out when it is unavailable, does not run the language, is
    weaker than untrusted code needs (``Capabilities.isolation_rank``), lacks a guest kernel that
    is asked for, or cannot do the I/O (no processes for syscall-heavy work, no egress for network
    work). Of the rest, the cheapest for the I/O profile wins: the tier's measured ratio from
    ``profile`` (``warmbox bench profile``) when there is one, else its declared slowdown; costs
    within SAME_COST are a tie, broken by the faster start, then the stronger isolation.
    NoSuitableTier if no tier is left: never a weaker tier instead. ``profile_note``: why there is
    no profile (or why it was set aside), said in the reasons. ``egress``: the sandbox gets a
    network policy, so a tier without a network mode besides "none" is out whatever ``req.io``;
    ``template``: the sandbox names a template (a tier without images is out); ``volumes``: it
    mounts volumes (a tier without files is out).
    """
    rejected: dict[str, str] = {}
    fit: list[tuple[TierCandidate, Capabilities]] = []
    for c in candidates:
        why = _unfit(req, c, egress, template, volumes)
        if why:
            rejected[c.tier] = why
        else:
            assert c.capabilities is not None
            fit.append((c, c.capabilities))
    asked = f"{req.language}, {'trusted' if req.trusted else 'untrusted'} code, {req.io} I/O" + (
        ", a guest kernel of its own" if req.guest_kernel else ""
    )
    if not fit:
        raise NoSuitableTier(
            f"no tier on this host fits {asked}: " + "; ".join(f"{tier}: {why}" for tier, why in rejected.items()),
            tuple(f"{tier}: {why}" for tier, why in rejected.items()),
        )
    measured = {t.tier: t for t in profile.tiers} if profile is not None else {}
    costed = []
    for c, caps in fit:
        m = measured.get(c.tier)
        if m is not None and m.cost_note != caps.cost_note:
            m = None  # measured under another configuration (platform, accelerator)
        cost, source = _cost(req, caps, m)
        if m is None and c.tier in measured:
            source += "; its measured profile was of another configuration: " + measured[c.tier].cost_note
        costed.append((cost, caps, source))
    cheapest = min(cost for cost, _, _ in costed)
    tied = [x for x in costed if x[0] <= cheapest * SAME_COST]
    cost, caps, source = min(tied, key=lambda x: (x[1].start_ms, -x[1].isolation_rank, x[0]))
    reasons = [f"asked: {asked}"]
    reasons.append(f"runs {req.language}")
    if req.trusted:
        reasons.append("trusted code: any isolation qualifies, so the cost decides")
    else:
        reasons.append(
            f"isolation rank {caps.isolation_rank} ({ISOLATION_RANKS.get(caps.isolation_rank, '?')}) meets "
            f"untrusted code's {UNTRUSTED_MIN_RANK}+: {caps.isolation}"
        )
    if req.guest_kernel:
        reasons.append("has a guest kernel of its own")
    if req.io == "network":
        reasons.append(f"egress: network modes {', '.join(caps.network_modes)}")
    reasons.append(f"{req.io} work runs at ~{cost:.1f}x the host's time here ({source})")
    if len(tied) > 1:
        others = ", ".join(x[1].tier for x in tied if x[1] is not caps)
        reasons.append(f"as cheap as {others} (within {SAME_COST:g}x); starts faster (~{caps.start_ms:g} ms)")
    if profile is None:
        reasons.append(
            "decided from the tiers' declared capabilities and costs: "
            + (profile_note or "no measured profile of this host (run: warmbox bench profile)")
        )
    for other_cost, other, other_source in costed:
        if other is caps:
            continue
        if other_cost > cheapest * SAME_COST:
            rejected[other.tier] = f"slower for {req.io} work: ~{other_cost:.1f}x the host's time ({other_source})"
        elif other.start_ms > caps.start_ms:
            rejected[other.tier] = (
                f"as cheap for {req.io} work (~{other_cost:.1f}x) but starts slower "
                f"(~{other.start_ms:g} ms against ~{caps.start_ms:g} ms)"
            )
        elif other.isolation_rank < caps.isolation_rank:
            rejected[other.tier] = (
                f"as cheap for {req.io} work (~{other_cost:.1f}x) and as fast to start, but isolates less "
                f"(rank {other.isolation_rank} against {caps.isolation_rank})"
            )
        else:
            rejected[other.tier] = f"a little slower for {req.io} work (~{other_cost:.1f}x against ~{cost:.1f}x)"
    return TierChoice(
        tier=caps.tier,
        reasons=tuple(reasons),
        rejected=dict(sorted(rejected.items())),
        profile_at=profile.measured_at if profile is not None else 0.0,
    )
