"""The registry's shared pieces: the state sets its queries use, row helpers and checks used by more than one store."""

from __future__ import annotations

import json
import math
import re

from warmbox.errors import InvalidArgument, SandboxNotFound
from warmbox.lifecycle import LIVE
from warmbox.models import State, Tenant
from warmbox.storage.sql import Conn

_COLUMNS = (
    "sandbox_id, tier, template, state, created_at, expires_at, memory_mb, cpus, pids, uid_slot, "
    "runtime_id, state_dir, socket_path, pool, claimed_at, parent_snapshot, metadata, "
    "on_timeout, idle_pause_after, auto_resume, template_version, image_id, requirements, tier_reasons, tier_rejected, "
    "tenant, node"
)

GIB = float(1 << 30)
HOUR = 3600.0
_MAX_APPROVAL_TEXT = 500
_LIVE = tuple(s.value for s in LIVE)
_HOLDING = (*_LIVE, State.FAILED.value)  # states whose uid range is still in use
_SPARE = (State.POOLED.value, State.RETIRING.value)  # a pool's warm spares (they yield a slot to a user's sandbox)
_QUOTA = (State.CREATING.value, State.READY.value, State.RUNNING.value)


def unknown_sandbox(sandbox_id: str) -> SandboxNotFound:
    """The error for an id the registry has no row for (and, to a tenant, for another tenant's)."""
    return SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)


def _quota(name: str, value: object, *, integer: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        ok = False
    else:
        assert isinstance(value, (int, float))
        ok = math.isfinite(value) and value >= 0
    if not ok:
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"{name} must be {kind} >= 0 (0: unlimited), got {value!r}")


def _in(values: tuple[str, ...]) -> str:
    return "(" + ",".join("?" * len(values)) + ")"


def _strings(text: str) -> tuple[str, ...]:
    try:
        v = json.loads(text)
    except ValueError:
        return ()
    return tuple(x for x in v if isinstance(x, str)) if isinstance(v, list) else ()


def _add_usage(db: Conn, tenant: str, at: float, cpu_s: float, gib_s: float) -> None:
    """Count use in ``tenant``'s bucket of the UTC hour of ``at`` (in the caller's transaction)."""
    if cpu_s <= 0 and gib_s <= 0:
        return
    db.execute(
        "INSERT INTO usage (tenant, hour, cpu_s, gib_s) VALUES (?,?,?,?) ON CONFLICT (tenant, hour) "
        "DO UPDATE SET cpu_s=usage.cpu_s+excluded.cpu_s, gib_s=usage.gib_s+excluded.gib_s",
        (tenant, math.floor(at / HOUR) * HOUR, max(0.0, cpu_s), max(0.0, gib_s)),
    )


_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # as config's [cluster] node


def _node_name(name: object, *, empty: bool = False) -> None:
    if isinstance(name, str) and ((empty and name == "") or _NODE_NAME.match(name)):
        return
    raise InvalidArgument(
        f"a node name is 1-63 lower-case letters, digits and '-' (not starting with '-'), got {name!r}"
    )


def _split(tiers: str) -> tuple[str, ...]:
    return tuple(t for t in tiers.split(",") if t)


_POOL_COST_COLUMNS = ("pool", "sandbox_id", "cpu_s", "gib_s", "wall_s")


def _tenant_lock(tenant: Tenant | None) -> tuple[str, ...]:
    """The advisory lock around a tenant's quota check and the write it allows (PostgreSQL)."""
    return () if tenant is None else (f"tenant:{tenant.name}",)
