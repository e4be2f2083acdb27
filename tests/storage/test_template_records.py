"""Template version records in the registry (schema 9): versions per tenant and name, never reused;
the same build twice adds nothing; a version 8 database gains the tables."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from warmbox.errors import InvalidArgument, TemplateNotFound
from warmbox.models import TemplateInfo
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(tmp: Path, at: str | None = None) -> Registry:
    return Registry(at or tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _info(name: str = "web", image: str = "sha256:" + "a" * 64, spec: str = "s1", tenant: str = "") -> TemplateInfo:
    return TemplateInfo(
        name=name,
        version=0,
        image_id=image,
        layers=("sha256:" + "1" * 64, "sha256:" + "2" * 64),
        env=(("PATH", "/usr/bin:/bin"), ("A", "x=y")),
        workdir="/srv",
        user="app",
        warmup_code="import numpy",
        warmup_commands=("true", "echo hi"),
        source="debian:bookworm",
        spec_hash=spec,
        size_bytes=123,
        created_at=1700000000.5,
        build_log="web-1.log",  # a name in <home>/templates/logs (rows of older builds: their path, read as this)
        tenant=tenant,
        description="a web image",
    )


def test_versions_count_up_per_name_and_tenant_and_are_never_reused(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    v1 = reg.templates.template_add(_info())
    assert v1.version == 1 and v1 == _info().__class__(**{**_info().__dict__, "version": 1})
    assert reg.templates.template_add(_info()) == v1  # the same spec and image: the latest, unchanged
    v2 = reg.templates.template_add(_info(image="sha256:" + "b" * 64))
    assert v2.version == 2
    assert reg.templates.template_add(_info(spec="s2", image="sha256:" + "b" * 64)).version == 3
    assert reg.templates.template_add(_info(tenant="acme")).version == 1  # another tenant's name
    assert reg.templates.template_get("web").version == 3
    assert reg.templates.template_get("web", 1) == v1
    assert reg.templates.template_get("web", tenant="acme").tenant == "acme"
    assert [(t.tenant, t.name, t.version) for t in reg.templates.template_list()] == [
        ("", "web", 1),
        ("", "web", 2),
        ("", "web", 3),
        ("acme", "web", 1),
    ]
    assert [t.version for t in reg.templates.template_list("acme")] == [1]
    assert reg.templates.template_layers() == {"sha256:" + "1" * 64, "sha256:" + "2" * 64}
    assert [t.version for t in reg.templates.template_delete("web", 3)] == [3]
    assert reg.templates.template_add(_info(spec="s3")).version == 4  # 3 is not given again
    removed = reg.templates.template_delete("web")
    assert sorted(t.version for t in removed) == [1, 2, 4]
    with pytest.raises(TemplateNotFound) as e:
        reg.templates.template_get("web")
    assert e.value.template == "web"
    with pytest.raises(TemplateNotFound):
        reg.templates.template_get("web", 2, tenant="acme")
    with pytest.raises(TemplateNotFound):
        reg.templates.template_delete("web")
    assert reg.templates.template_add(_info()).version == 5
    with pytest.raises(InvalidArgument):
        reg.templates.template_add(_info(name="../x"))
    reg.close()
    again = _registry(tmp_path, at=registry_at)
    assert again.templates.template_get("web").version == 5 and again.templates.template_get("web").env == _info().env


def test_a_version_8_database_gains_the_template_tables(tmp_path):
    assert SCHEMA_VERSION >= 9
    db = sqlite3.connect(tmp_path / "r.db")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    db.execute("PRAGMA user_version=8")
    db.commit()
    db.close()
    reg = _registry(tmp_path)
    assert reg.templates.template_add(_info()).version == 1
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_template_versions_pin_their_layers_for_every_homes_gc(tmp_path, registry_at):
    from warmbox.storage.layers import LayerStore
    from warmbox.storage.templates import add_template, collect, delete_template

    store = LayerStore(tmp_path / "cache")
    digests = []
    for i in range(3):
        t = tmp_path / f"t{i}"
        t.mkdir()
        (t / "f").write_text(str(i))
        digests.append(store.add_tree(t, owner_base=0).digest)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    home_a = _registry(tmp_path / "a")
    home_b = _registry(tmp_path / "b")
    info = dataclasses.replace(_info(), layers=(digests[0],))
    assert add_template(home_a, store, info).version == 1
    assert (
        add_template(
            home_b, store, dataclasses.replace(info, layers=(digests[1],), image_id="sha256:" + "c" * 64)
        ).version
        == 1
    )
    # home b's gc does not know home a's template, the pin keeps its layer
    assert collect(home_b, store, keep=[]) == [digests[2]]
    assert delete_template(home_a, store, "web")[0].version == 1
    assert collect(home_b, store) == [digests[0]]
    # a removed home's pins go at the next collect
    home_b.close()
    import shutil

    shutil.rmtree(tmp_path / "b")
    assert collect(home_a, store) == [digests[1]] and store.pinned() == {}
