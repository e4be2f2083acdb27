"""KeyStore: idempotency keys, each claimed before its request runs and then its result."""

from __future__ import annotations

import builtins
import dataclasses
import time

from warmbox.storage.registry.db import Database, Store, _retried

IDEM_PURGE_EVERY = 256  # claims between two purges of expired idempotency keys
_IDEM_CLAIM_COLUMNS = (
    "tenant",
    "scope",
    "idem_key",
    "op",
    "fingerprint",
    "state",
    "holder",
    "created_at",
    "expires_at",
    "deadline",
)

_IDEM_COLUMNS = ", ".join((*_IDEM_CLAIM_COLUMNS, "sandbox_id", "result"))


# a claim: inserted, or replacing an expired record; RETURNING says whether it was (SQLite >= 3.35)
_IDEM_CLAIM = (
    f"INSERT INTO idempotency_keys ({', '.join(_IDEM_CLAIM_COLUMNS)}) VALUES ({','.join('?' * 10)}) "
    "ON CONFLICT (tenant, scope, idem_key) DO UPDATE SET "
    + ", ".join(f"{c}=excluded.{c}" for c in _IDEM_CLAIM_COLUMNS[3:])
    + ", sandbox_id='', result='' WHERE idempotency_keys.expires_at <= excluded.created_at RETURNING holder"
)


def _claim_row(c: KeyClaim) -> tuple[str, str, str, str, str, str, str, float, float, float]:
    """A claim as _IDEM_CLAIM inserts it (state "started"); not dataclasses.astuple: it deep-copies."""
    return (c.tenant, c.scope, c.key, c.op, c.fingerprint, "started", c.holder, c.created_at, c.expires_at, c.deadline)


@dataclasses.dataclass(frozen=True)
class KeyClaim:
    """A keyed call, as recorded before it starts. tenant: "" for the host's root; scope: the
    sandbox of a command or code run, "" for a create; holder: the claiming process and a nonce
    (engine/idempotency.py); deadline: when a started call must have ended (0: unknown)."""

    tenant: str
    scope: str
    key: str
    op: str
    fingerprint: str
    holder: str
    created_at: float
    expires_at: float
    deadline: float


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """A key's record: its claim, its state ("started", "done", "failed"), the sandbox a create
    made, and the result (or typed error) as JSON once it ended."""

    claim: KeyClaim
    state: str
    sandbox_id: str
    result: str


def _key_record(r: tuple) -> KeyRecord:
    claim = KeyClaim(
        tenant=r[0],
        scope=r[1],
        key=r[2],
        op=r[3],
        fingerprint=r[4],
        holder=r[6],
        created_at=r[7],
        expires_at=r[8],
        deadline=r[9],
    )
    return KeyRecord(claim=claim, state=r[5], sandbox_id=r[10], result=r[11])


class KeyStore(Store):
    """Idempotency keys, each claimed before its request runs and then its result."""

    def __init__(self, base: Database) -> None:
        super().__init__(base)
        self._claims = 0  # idempotency keys claimed through this object (their purge's cadence)

    @_retried
    def claim_key(self, claim: KeyClaim) -> KeyRecord | None:
        """Record ``claim`` (state "started") and commit it, unless the tenant's key is taken in its
        scope: None if this claim won, else the record that holds the key. An expired record is
        replaced. One statement on the fast path (its cost is on every keyed call: ``warmbox bench
        exec``); every IDEM_PURGE_EVERY claims, the expired records of every tenant go too."""
        self._claims += 1
        with self._tx() as db:
            if self._claims % IDEM_PURGE_EVERY == 0:
                db.execute("DELETE FROM idempotency_keys WHERE expires_at<=?", (claim.created_at,))
            won = db.execute(_IDEM_CLAIM, _claim_row(claim)).fetchall()
            if won:
                return None
            row = db.execute(
                f"SELECT {_IDEM_COLUMNS} FROM idempotency_keys WHERE tenant=? AND scope=? AND idem_key=?",
                (claim.tenant, claim.scope, claim.key),
            ).fetchone()
        return None if row is None else _key_record(row)

    @_retried
    def release_key(self, claim: KeyClaim) -> None:
        """Forget a claim whose call did nothing (refused before it started): its key is free again."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM idempotency_keys "
                "WHERE tenant=? AND scope=? AND idem_key=? AND holder=? AND state='started'",
                (claim.tenant, claim.scope, claim.key, claim.holder),
            )

    @_retried
    def finish_keys(self, outcomes: builtins.list[tuple[KeyClaim, str, str, str]]) -> None:
        """Record the outcomes of started calls, in one transaction: (claim, state "done" with
        its result as JSON or "failed" with its typed error as JSON, that JSON, the sandbox a
        create made or ""); each only while the record is still that claim's."""
        if not outcomes:
            return
        with self._tx() as db:
            db.executemany(
                "UPDATE idempotency_keys SET state=?, result=?, sandbox_id=? "
                "WHERE tenant=? AND scope=? AND idem_key=? AND holder=? AND state='started'",
                [(state, result, sid, c.tenant, c.scope, c.key, c.holder) for c, state, result, sid in outcomes],
            )

    def key_record(self, tenant: str, scope: str, key: str) -> KeyRecord | None:
        """The record of a tenant's key in a scope (None: none, or expired)."""
        row = self._read(
            f"SELECT {_IDEM_COLUMNS} FROM idempotency_keys WHERE tenant=? AND scope=? AND idem_key=? AND expires_at>?",
            (tenant, scope, key, time.time()),
        )
        return None if row is None else _key_record(row)
