"""The tier selector's view of this host: each tier's capabilities and availability, and the
measured profile ``warmbox bench profile`` caches in the home (read back here, checked, never trusted
blindly: a profile of another kernel, CPU or tier configuration is set aside, and the reasons say so)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from warmbox import tiers
from warmbox.errors import BackendUnavailable, InvalidArgument, WarmboxError
from warmbox.models import HostProfile, Requirements, Tenant, TierCandidate, TierChoice
from warmbox.paths import cache_dir

PROFILE_FILE = "tier-profile.json"
MAX_PROFILE_BYTES = 1 << 16


def profile_path(home: Path) -> Path:
    return cache_dir(home) / PROFILE_FILE


def host_facts() -> tuple[str, str, int]:
    """(kernel release, CPU model, CPUs): what a cached profile must have been measured on."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return platform.release(), model, os.cpu_count() or 1


def save_profile(home: Path, profile: HostProfile) -> Path:
    """Write ``profile`` as the home's cached one (atomically); returns its path."""
    from warmbox.wire import encode

    path = profile_path(home)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{PROFILE_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(encode(profile), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_profile(home: Path) -> tuple[HostProfile | None, str]:
    """The home's cached profile if it is usable on this host now, else None and why."""
    from warmbox.wire import decode

    path = profile_path(home)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except FileNotFoundError:
        return None, "no measured profile of this host (run: warmbox bench profile)"
    except OSError as e:
        return None, f"the cached profile {path} is unreadable ({e.strerror})"
    try:
        if len(raw) > MAX_PROFILE_BYTES:
            raise InvalidArgument("too large")
        data: Any = json.loads(raw)
        profile: HostProfile = decode(HostProfile, data, "profile")
    except (ValueError, InvalidArgument) as e:
        return None, f"the cached profile {path} is not a profile ({e}); run: warmbox bench profile"
    kernel, model, cpus = host_facts()
    if (profile.kernel, profile.cpu_model, profile.cpus) != (kernel, model, cpus):
        return None, (
            f"the cached profile was measured on another host (kernel {profile.kernel}, {profile.cpus} CPUs "
            f"{profile.cpu_model}; this one: {kernel}, {cpus} CPUs {model}); run: warmbox bench profile"
        )
    return profile, ""


def candidates(engine: Any, tenant: Tenant | None = None) -> list[TierCandidate]:
    """Every tier of this build with its capabilities and whether this host and ``tenant`` may run it."""
    out = []
    for tier in tiers.TIERS:
        try:
            backend = engine.backend(tier)
            caps = backend.capabilities()
            avail = backend.probe()
        except BackendUnavailable as e:
            out.append(TierCandidate(tier, None, False, e.reason))
            continue
        except WarmboxError as e:  # a probe that failed is an unavailable tier, with its reason
            out.append(TierCandidate(tier, None, False, str(e)))
            continue
        if avail.available and tenant is not None and tenant.tiers and tier not in tenant.tiers:
            out.append(TierCandidate(tier, caps, False, f"not among this key's tiers ({', '.join(tenant.tiers)})"))
        else:
            out.append(TierCandidate(tier, caps, avail.available, avail.reason))
    return out


def choose(
    engine: Any,
    req: Requirements,
    tenant: Tenant | None = None,
    *,
    egress: bool = False,
    template: str = "",
    volumes: bool = False,
) -> TierChoice:
    """The tier for ``req`` on this host (tiers.choose over :func:`candidates` and the cached profile);
    egress, template, volumes: what the sandbox to create asks for besides (see tiers.choose)."""
    if not isinstance(req, Requirements):
        raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(req).__name__}")
    profile, note = load_profile(engine.home)
    choice = tiers.choose(
        req, candidates(engine, tenant), profile, note, egress=egress, template=template, volumes=volumes
    )
    if profile is not None:
        age_h = (time.time() - profile.measured_at) / 3600
        choice = TierChoice(
            choice.tier,
            (*choice.reasons, f"profile measured {age_h:.1f} h ago by warmbox bench profile"),
            choice.rejected,
            choice.profile_at,
        )
    return choice


__all__ = ["candidates", "choose", "host_facts", "load_profile", "profile_path", "save_profile"]
