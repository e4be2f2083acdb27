"""TemplateStore: templates, their versions and the build steps a build reuses."""

from __future__ import annotations

import builtins
import dataclasses
import json
import re
import time
from pathlib import Path

from warmbox.errors import InvalidArgument, RegistryError, TemplateNotFound
from warmbox.models import State, TemplateInfo
from warmbox.storage.registry.common import _strings
from warmbox.storage.registry.db import Store, _retried


def _build_step_tenant(tenant: str) -> None:
    # the host's own steps (no tenant) live in the host-wide layer store, never here
    if not isinstance(tenant, str) or not tenant:
        raise InvalidArgument("a build step recorded in the registry belongs to a tenant (a non-empty name)")


_TEMPLATE_COLUMNS = (
    'name, version, image_id, layers, env, workdir, "user", warmup_code, warmup_commands, source, '
    "spec_hash, size_bytes, created_at, build_log, tenant, description"
)

_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _template_name(name: object) -> None:
    if not isinstance(name, str) or not _TEMPLATE_NAME.match(name):
        raise InvalidArgument(f"a template name is 1-128 letters, digits, '_', '.', '-' (not first), got {name!r}")


def _template_row(t: TemplateInfo) -> tuple:
    """A TemplateInfo as its templates row (in _TEMPLATE_COLUMNS order; tuples as JSON lists)."""
    return (
        t.name,
        t.version,
        t.image_id,
        json.dumps(list(t.layers)),
        json.dumps([[k, v] for k, v in t.env]),
        t.workdir,
        t.user,
        t.warmup_code,
        json.dumps(list(t.warmup_commands)),
        t.source,
        t.spec_hash,
        t.size_bytes,
        t.created_at,
        t.build_log,
        t.tenant,
        t.description,
    )


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    try:
        v = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(v, list):
        return ()
    return tuple((p[0], p[1]) for p in v if isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p))


def _template(r: tuple) -> TemplateInfo:
    return TemplateInfo(
        name=r[0],
        version=r[1],
        image_id=r[2],
        layers=_strings(r[3]),
        env=_pairs(r[4]),
        workdir=r[5],
        user=r[6],
        warmup_code=r[7],
        warmup_commands=_strings(r[8]),
        source=r[9],
        spec_hash=r[10],
        size_bytes=r[11],
        created_at=r[12],
        build_log=Path(r[13]).name,  # rows before names were recorded hold the log's host path
        tenant=r[14],
        description=r[15],
    )


class TemplateStore(Store):
    """Templates, their versions and the build steps a build reuses."""

    def template_users(
        self, template: str, version: int | None = None, tenant: str = ""
    ) -> tuple[builtins.list[str], builtins.list[str], builtins.list[str]]:
        """What uses ``template`` (of ``version``, or any): (ids of sandboxes not destroyed, names of
        pools holding some, ids of snapshots taken of its sandboxes), of one tenant ("": the host's)."""
        where = "s.template=? AND s.tenant=?"
        args: builtins.list[object] = [template, tenant]
        if version is not None:
            where += " AND s.template_version=?"
            args.append(version)
        live = self._read(
            f"SELECT s.sandbox_id, s.pool, s.state FROM sandboxes s WHERE {where} AND s.state<>? ORDER BY s.created_at",
            (*args, State.DESTROYED.value),
            many=True,
        )
        snaps = self._read(
            f"SELECT n.snapshot_id FROM snapshots n JOIN sandboxes s ON s.sandbox_id=n.sandbox_id WHERE {where} "
            "ORDER BY n.created_at",
            tuple(args),
            many=True,
        )
        pools = sorted({r[1] for r in live if r[1] and r[2] == State.POOLED.value})
        return [r[0] for r in live], pools, [r[0] for r in snaps]

    @_retried
    def template_add(self, info: TemplateInfo) -> TemplateInfo:
        """Record a built template as the next version of its (tenant, name): the record returned
        has ``version`` = the last version ever given + 1 (``info.version`` is ignored; numbers are
        never reused, even after a removal). If the latest version has the same spec_hash and
        image_id, nothing is added and that version is returned."""
        _template_name(info.name)
        with self._tx(f"template:{info.tenant}/{info.name}") as db:  # two builds of one name: one version each
            row = db.execute(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? ORDER BY version DESC LIMIT 1",
                (info.tenant, info.name),
            ).fetchone()
            if row is not None:
                latest = _template(row)
                if latest.spec_hash == info.spec_hash and latest.image_id == info.image_id:
                    return latest
            last = db.execute(
                "SELECT last FROM template_versions WHERE tenant=? AND name=?", (info.tenant, info.name)
            ).fetchone()
            version = max(last[0] if last else 0, _template(row).version if row else 0) + 1
            out = dataclasses.replace(info, version=version)
            db.execute(f"INSERT INTO templates ({_TEMPLATE_COLUMNS}) VALUES ({','.join('?' * 16)})", _template_row(out))
            db.execute(
                self._sql.upsert("template_versions", ("tenant", "name", "last"), ("tenant", "name")),
                (info.tenant, info.name, version),
            )
        return out

    def template_get(self, name: str, version: int | None = None, tenant: str = "") -> TemplateInfo:
        """A template version (None: the latest) of the tenant's; TemplateNotFound if none."""
        if version is None:
            row = self._read(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? ORDER BY version DESC LIMIT 1",
                (tenant, name),
            )
        else:
            row = self._read(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? AND version=?",
                (tenant, name, version),
            )
        if row is None:
            which = f"{name!r}" if version is None else f"{name!r} version {version}"
            raise TemplateNotFound(f"no template {which}", template=name)
        return _template(row)

    def template_list(self, tenant: str | None = None) -> builtins.list[TemplateInfo]:
        """Every template version (tenant: only that tenant's), by tenant, name, then version."""
        q = f"SELECT {_TEMPLATE_COLUMNS} FROM templates"
        rows = self._read(
            q + (" WHERE tenant=?" if tenant is not None else "") + " ORDER BY tenant, name, version",
            (tenant,) if tenant is not None else (),
            many=True,
        )
        return [_template(r) for r in rows]

    @_retried
    def template_delete(self, name: str, version: int | None = None, tenant: str = "") -> builtins.list[TemplateInfo]:
        """Remove one version (None: every version) of a template; the records removed.
        TemplateNotFound if there was none. Whether something still uses it is the caller's check."""
        with self._tx() as db:
            where = "tenant=? AND name=?" + ("" if version is None else " AND version=?")
            args: tuple = (tenant, name) if version is None else (tenant, name, version)
            rows = db.execute(f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE {where}", args).fetchall()
            db.execute(f"DELETE FROM templates WHERE {where}", args)
        if not rows:
            which = f"{name!r}" if version is None else f"{name!r} version {version}"
            raise TemplateNotFound(f"no template {which}", template=name)
        return [_template(r) for r in rows]

    def recorded_image_ids(self) -> set[str]:
        """Image ids sandboxes that are not destroyed (paused ones too) and snapshots recorded."""
        rows = self._read(
            "SELECT image_id FROM sandboxes WHERE state<>? UNION SELECT image_id FROM snapshots",
            (State.DESTROYED.value,),
            many=True,
        )
        return {r[0] for r in rows if r[0]}

    def build_step(self, tenant: str, key: str) -> str | None:
        """The layer digest ``tenant``'s build step ``key`` made (engine/builder.py), or None. Only
        that tenant's own rows are read: another tenant's step is never found."""
        _build_step_tenant(tenant)
        row = self._read("SELECT digest FROM build_steps WHERE tenant=? AND step_key=?", (tenant, key))
        return row[0] if row else None

    @_retried
    def record_build_step(self, tenant: str, key: str, digest: str) -> None:
        """Record that ``tenant``'s build step ``key`` made the layer ``digest`` (replacing any earlier)."""
        _build_step_tenant(tenant)
        if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{64}", key):
            raise InvalidArgument(f"a build step key is 64 hex digits, got {str(key)[:80]!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise InvalidArgument(f"not a layer digest (sha256:<64 hex>): {str(digest)[:80]!r}")
        cols = ("tenant", "step_key", "digest", "created_at")
        try:
            with self._tx() as db:
                db.execute(
                    self._sql.upsert("build_steps", cols, ("tenant", "step_key")), (tenant, key, digest, time.time())
                )
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def template_layers(self) -> set[str]:
        """Every layer digest some template version (of any tenant) records: what layer gc keeps."""
        rows = self._read("SELECT layers FROM templates", many=True)
        out: set[str] = set()
        for (text,) in rows:
            out.update(_strings(text))
        return out
