"""TenantStore: tenants, their quotas and API keys (hashes only)."""

from __future__ import annotations

import builtins
import hashlib
import hmac
import re
import secrets
import time

from warmbox.errors import InvalidArgument, QuotaExceeded, RegistryError
from warmbox.models import KeyInfo, Limits, Tenant
from warmbox.storage.registry.common import _QUOTA, _in, _quota, _split
from warmbox.storage.registry.db import Store, _retried
from warmbox.storage.sql import Conn
from warmbox.tiers import canonical_tier

_KEY_TENANT = (
    "SELECT k.secret_sha256, k.revoked_at, k.key_id, k.admin, t.name, t.max_sandboxes, t.max_memory_mb, "
    "t.max_cpus, t.tiers, t.rate_per_s, t.budget_cpu_h, t.budget_gib_h FROM api_keys k "
    "JOIN tenants t ON t.name=k.tenant "
)


def _key_tenant(row: tuple) -> Tenant:
    """A key row (see _KEY_TENANT) as the Tenant a request with that key acts as."""
    return Tenant(
        name=row[4],
        admin=bool(row[3]),
        max_sandboxes=row[5],
        max_memory_mb=row[6],
        max_cpus=row[7],
        tiers=_split(row[8]),
        rate_per_s=row[9],
        key_id=row[2],
        budget_cpu_h=row[10],
        budget_gib_h=row[11],
    )


_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
SECRET_PREFIX = "wbx_"
_MAX_SECRET = 256


def _secret_hash(secret: str) -> str:
    # the secret is 256 random bits: a plain hash is enough (nothing to brute-force), and it is fast
    return hashlib.sha256(secret.encode()).hexdigest()


def _tiers(tiers: object) -> str:
    if isinstance(tiers, str) or not isinstance(tiers, (list, tuple)):
        raise InvalidArgument(f"tiers must be a list of tier names, got {tiers!r}")
    out: builtins.list[str] = []
    for t in tiers:
        c = canonical_tier(t)
        if c not in out:
            out.append(c)
    return ",".join(out)


class TenantStore(Store):
    """Tenants, their quotas and API keys (hashes only)."""

    @_retried
    def create_key(
        self,
        tenant: str,
        *,
        admin: bool = False,
        max_sandboxes: int | None = None,
        max_memory_mb: int | None = None,
        max_cpus: float | None = None,
        tiers: tuple[str, ...] | builtins.list[str] | None = None,
        rate_per_s: float | None = None,
        budget_cpu_h: float | None = None,
        budget_gib_h: float | None = None,
    ) -> tuple[str, str]:
        """A new API key of ``tenant`` (made if new); returns (key_id, secret). Only the secret's
        SHA-256 is stored: the secret is shown to the caller once and never again. Quotas and
        budgets given (not None) replace the tenant's; the others stay (a new tenant: 0 =
        unlimited, every tier, no budget). budget_*: per UTC day, CPU-hours and GiB-hours."""
        if not isinstance(tenant, str) or not _TENANT_NAME.match(tenant):
            raise InvalidArgument(
                f"tenant must be 1-64 characters (letters, digits, '_', '.', '@', '-'; not starting with "
                f"a symbol), got {tenant!r}"
            )
        if not isinstance(admin, bool):
            raise InvalidArgument(f"admin must be True or False, got {admin!r}")
        updates: builtins.list[tuple[str, object]] = []
        quotas: tuple[tuple[str, object, bool], ...] = (
            ("max_sandboxes", max_sandboxes, True),
            ("max_memory_mb", max_memory_mb, True),
            ("max_cpus", max_cpus, False),
            ("rate_per_s", rate_per_s, False),
            ("budget_cpu_h", budget_cpu_h, False),
            ("budget_gib_h", budget_gib_h, False),
        )
        for col, value, integer in quotas:
            if value is not None:
                _quota(col, value, integer=integer)
                updates.append((col, value))
        if tiers is not None:
            updates.append(("tiers", _tiers(tiers)))
        key_id = "key-" + secrets.token_hex(6)
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._tx() as db:
            db.execute(self._sql.upsert("tenants", ("name", "created_at"), ("name",), ()), (tenant, now))
            for col, value in updates:  # col: one of the fixed names above
                db.execute(f"UPDATE tenants SET {col}=? WHERE name=?", (value, tenant))
            db.execute(
                "INSERT INTO api_keys (key_id, tenant, secret_sha256, created_at, admin) VALUES (?,?,?,?,?)",
                (key_id, tenant, _secret_hash(secret), now, int(admin)),
            )
        return key_id, secret

    def list_keys(self) -> builtins.list[KeyInfo]:
        """Every key, revoked ones too, oldest first (never a secret: the registry has none)."""
        rows = self._read(
            "SELECT k.key_id, k.tenant, k.created_at, k.revoked_at, k.admin, t.max_sandboxes, t.max_memory_mb, "
            "t.max_cpus, t.tiers, t.rate_per_s, t.budget_cpu_h, t.budget_gib_h FROM api_keys k "
            "JOIN tenants t ON t.name=k.tenant ORDER BY k.created_at, k.key_id",
            many=True,
        )
        return [
            KeyInfo(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7], _split(r[8]), r[9], r[10], r[11])
            for r in rows
        ]

    @_retried
    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key at once (the next request with it is refused); False if unknown or already revoked."""
        if not isinstance(key_id, str):
            return False
        with self._tx() as db:
            n = db.execute(
                "UPDATE api_keys SET revoked_at=? WHERE key_id=? AND revoked_at=0", (time.time(), key_id)
            ).rowcount
        return n == 1

    def authenticate(self, secret: str) -> Tenant | None:
        """The tenant (with its current quotas, and the key's admin flag and id) of a live key's
        secret; None for anything else. One indexed read: it runs on every request."""
        if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX) or len(secret) > _MAX_SECRET:
            return None
        digest = _secret_hash(secret)
        row = self._read(_KEY_TENANT + "WHERE k.secret_sha256=?", (digest,))
        if row is None or not hmac.compare_digest(row[0], digest) or row[1]:
            return None
        return _key_tenant(row)

    def key_tenant(self, key_id: str) -> Tenant | None:
        """What :meth:`authenticate` answers for the key with this id (the console's sessions hold
        the id, never the secret): None if the key is unknown or revoked. One indexed read."""
        if not isinstance(key_id, str):
            return None
        row = self._read(_KEY_TENANT + "WHERE k.key_id=?", (key_id,))
        if row is None or row[1]:
            return None
        return _key_tenant(row)

    def tenant(self, name: str) -> Tenant:
        """A tenant's quotas (admin False, no key); InvalidArgument if there is no such tenant."""
        row = self._read(
            "SELECT name, max_sandboxes, max_memory_mb, max_cpus, tiers, rate_per_s, budget_cpu_h, budget_gib_h "
            "FROM tenants WHERE name=?",
            (name,),
        )
        if row is None:
            raise InvalidArgument(f"no tenant {name!r}")
        return Tenant(
            name=row[0],
            max_sandboxes=row[1],
            max_memory_mb=row[2],
            max_cpus=row[3],
            tiers=_split(row[4]),
            rate_per_s=row[5],
            budget_cpu_h=row[6],
            budget_gib_h=row[7],
        )

    def check_quota(self, tenant: Tenant, tier: str, limits: Limits) -> None:
        """QuotaExceeded if one more sandbox of ``tier`` with ``limits`` would take ``tenant`` past
        its quotas now. An early refusal only: the insert or claim checks again, atomically."""
        try:
            self.check_quota_in(self._db, tenant, tier, limits.memory_mb, limits.cpus)
        except self._errors as e:
            raise RegistryError(f"registry read failed: {e}") from None

    def check_quota_in(self, db: Conn, tenant: Tenant, tier: str, memory_mb: int, cpus: float) -> None:
        """In the caller's transaction. The tenants table's quotas win over the Tenant record's (a
        quota changed by ``keys create`` applies to the next start); a tenant with no row (made in
        code, not by a key) is held to the record's. On PostgreSQL the caller's transaction holds
        the tenant's advisory lock (_tenant_lock): its count and the write it allows are one step."""
        row = db.execute(
            "SELECT max_sandboxes, max_memory_mb, max_cpus, tiers FROM tenants WHERE name=?", (tenant.name,)
        ).fetchone()
        if row is not None:
            max_n, max_mem, max_cpus, allowed = row[0], row[1], row[2], _split(row[3])
        else:
            max_n, max_mem, max_cpus, allowed = (
                tenant.max_sandboxes,
                tenant.max_memory_mb,
                tenant.max_cpus,
                tenant.tiers,
            )
        who = f"tenant {tenant.name!r}"
        if allowed and tier not in allowed:
            raise QuotaExceeded(
                f"{who} may not use tier {tier!r} (allowed: {', '.join(allowed)})",
                limit="tier",
                value=tier,
                maximum=",".join(allowed),
            )
        if not (max_n or max_mem or max_cpus):
            return
        n, used_mem, used_cpus = db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(memory_mb), 0), COALESCE(SUM(cpus), 0) FROM sandboxes "
            f"WHERE tenant=? AND state IN {_in(_QUOTA)}",
            (tenant.name, *_QUOTA),
        ).fetchone()
        if max_n and n + 1 > max_n:
            raise QuotaExceeded(
                f"{who} may run at most {max_n} sandboxes at once and has {n}: kill or pause one first",
                limit="sandboxes",
                value=n + 1,
                maximum=max_n,
            )
        if max_mem and used_mem + memory_mb > max_mem:
            raise QuotaExceeded(
                f"{who} may use at most {max_mem} MiB of sandbox memory: {used_mem} MiB in use "
                f"+ {memory_mb} MiB asked for",
                limit="memory_mb",
                value=used_mem + memory_mb,
                maximum=max_mem,
            )
        if max_cpus and used_cpus + cpus > max_cpus + 1e-9:
            raise QuotaExceeded(
                f"{who} may use at most {max_cpus:g} CPUs: {used_cpus:g} in use + {cpus:g} asked for",
                limit="cpus",
                value=used_cpus + cpus,
                maximum=max_cpus,
            )
