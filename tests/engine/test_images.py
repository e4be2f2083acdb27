"""Which image a sandbox runs: template versions resolved to layers, recorded images, mismatches, users.

Real layer store (a temp image cache) and real registry; no sandbox: these are the engine's
decisions. The sandbox side (image ids on running sandboxes, pools, restores) is test_images_sandbox.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from warmbox import images as builtin
from warmbox.config import Template, shape_key
from warmbox.engine import images, resolve, template_gc
from warmbox.engine.engine import Engine
from warmbox.errors import CorruptLayer, InvalidArgument, TemplateMismatch, TemplateNotFound
from warmbox.models import Limits, TemplateInfo, Tenant
from warmbox.storage import snapshots as snaps
from warmbox.storage.layers import LayerStore, image_id_of


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("WARMBOX_IMAGE_CACHE", str(path))
    images._built.clear()
    yield path
    images._built.clear()


@pytest.fixture
def engine(tmp_path: Path, cache: Path) -> Engine:
    return Engine(tmp_path / "home")


def _layer(cache: Path, tmp_path: Path, text: str) -> str:
    src = tmp_path / f"tree-{text}"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "wb-marker").write_text(text + "\n")
    return LayerStore(cache).add_tree(src, owner_base=0).digest


def _add(engine: Engine, name: str, digests: tuple[str, ...], tenant: str = "", **kw) -> TemplateInfo:
    info = TemplateInfo(
        name=name,
        version=0,
        image_id=image_id_of(digests, (), "", ""),
        layers=digests,
        tenant=tenant,
        created_at=time.time(),
        **kw,
    )
    return engine.registry.templates.template_add(info)


def test_image_for_takes_the_latest_version_and_recorded_image_the_recorded_one(engine, cache, tmp_path):
    d1, d2 = _layer(cache, tmp_path, "v1"), _layer(cache, tmp_path, "v2")
    v1 = _add(engine, "app", (d1,), warmup_commands=("true",))
    img = resolve.image_for(engine, "app")
    assert (img.template, img.version, img.image_id) == ("app", v1.version, v1.image_id)
    assert Path(img.layers[0], "etc/wb-marker").read_text() == "v1\n"
    assert resolve.template(engine, "app") == Template(name="app", warmup_code=None, warmup_commands=("true",))
    v2 = _add(engine, "app", (d2,))
    assert v2.version == v1.version + 1
    assert resolve.image_for(engine, "app").image_id == v2.image_id
    old = resolve.recorded_image(engine, "app", v1.version, v1.image_id)
    assert old.image_id == v1.image_id and Path(old.layers[0], "etc/wb-marker").read_text() == "v1\n"
    # a record that names another image than the version has now: refused, not silently swapped
    with pytest.raises(TemplateMismatch):
        resolve.recorded_image(engine, "app", v1.version, v2.image_id)


def test_a_recorded_image_whose_version_or_layer_is_gone_is_a_mismatch(engine, cache, tmp_path):
    d1, d2 = _layer(cache, tmp_path, "v1"), _layer(cache, tmp_path, "v2")
    v1, v2 = _add(engine, "app", (d1,)), _add(engine, "app", (d2,))
    engine.registry.templates.template_delete("app", v1.version)
    with pytest.raises(TemplateMismatch, match="no longer exists"):
        resolve.recorded_image(engine, "app", v1.version, v1.image_id)
    LayerStore(cache).remove(d2)  # the version is recorded, its layer collected
    with pytest.raises(TemplateMismatch, match="no longer in the layer store"):
        resolve.recorded_image(engine, "app", v2.version, v2.image_id)
    with pytest.raises(TemplateMismatch):
        resolve.image_for(engine, "app")


def test_a_layer_that_fails_its_digest_is_corrupt(engine, cache, tmp_path):
    d1 = _layer(cache, tmp_path, "v1")
    v1 = _add(engine, "app", (d1,))
    store = LayerStore(cache)
    blob = store.blobs / d1.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[600] ^= 0xFF  # one byte of the first file's data
    blob.write_bytes(bytes(data))
    import shutil

    shutil.rmtree(store.dirs / d1.split(":")[1])  # unpacked again from the (bad) blob
    with pytest.raises(CorruptLayer) as e:
        resolve.recorded_image(engine, "app", v1.version, v1.image_id)
    assert e.value.value == d1


def test_unknown_templates_and_tenants(engine, cache, tmp_path):
    with pytest.raises(InvalidArgument, match="unknown template 'nope'"):
        resolve.image_for(engine, "nope")
    d1 = _layer(cache, tmp_path, "v1")
    _add(engine, "mine", (d1,), tenant="alice")
    alice, bob = Tenant("alice"), Tenant("bob")
    assert resolve.image_for(engine, "mine", alice).template == "mine"
    with pytest.raises(InvalidArgument):
        resolve.image_for(engine, "mine", bob)  # another tenant's template is not there for bob
    with pytest.raises(InvalidArgument):
        resolve.image_for(engine, "mine")
    # the built-in image is not built in this empty cache: with build=False, a typed answer
    with pytest.raises(TemplateNotFound, match="bootstrap"):
        resolve.image_for(engine, "base", build=False)


def test_builtin_records_resolve_by_id(engine, cache, tmp_path):
    d1, d2 = _layer(cache, tmp_path, "a"), _layer(cache, tmp_path, "b")
    cache.mkdir(exist_ok=True)
    now = builtin.builtin_key()
    old = images.BuiltinRecord("builtin-0000000000000000", image_id_of((d1,), (), "", ""), (d1,), 1.0, 1.0)
    cur = images.BuiltinRecord(now, image_id_of((d1, d2), (), "", ""), (d1, d2), 2.0, 1.0)
    for rec in (old, cur):
        (cache / f"{rec.key}.json").write_text(json.dumps(dataclasses.asdict(rec)))
    base = resolve.image_for(engine, "base")
    assert (base.template, base.version, base.image_id) == ("base", 0, cur.image_id)
    assert resolve.image_for(engine, "pydata").image_id == cur.image_id  # one image, three warm-ups
    assert resolve.recorded_image(engine, "pydata", 0, old.image_id).layers == (str(LayerStore(cache).dirs / d1[7:]),)
    with pytest.raises(TemplateMismatch, match="no longer has"):
        resolve.recorded_image(engine, "base", 0, "sha256:" + "0" * 64)
    assert resolve.recorded_image(engine, "base", 0, "").image_id == cur.image_id  # from before images: the current
    # the doctor says it is built
    assert images.builtin_record() == cur
    assert template_gc.layers_in_use(engine) == {d1, d2}  # a layer gc keeps both builds' layers
    assert LayerStore(cache).pinned()[f"builtin:{now}"] == (d1, d2)  # ... and so does any home's gc


def test_a_template_with_a_build_of_its_own_is_not_the_builtin_image_until_built(engine, cache, tmp_path):
    (engine.home / "warmbox.toml").write_text('[templates.mine]\nfrom = "base"\nrun = ["true"]\n')
    with pytest.raises(TemplateNotFound, match="warmbox template build mine"):
        resolve.image_for(engine, "mine")
    with pytest.raises(TemplateNotFound, match="warmbox template build browser"):
        resolve.image_for(engine, "browser")
    d1 = _layer(cache, tmp_path, "v1")
    built = _add(engine, "mine", (d1,))
    assert resolve.image_for(engine, "mine").image_id == built.image_id


def test_memory_snapshot_without_an_image_is_refused(engine):
    from warmbox.engine.snapstore import image_of

    m = snaps.SnapshotManifest(
        snapshot_id="snap-x",
        sandbox_id="sb-000000000000",
        parent="",
        created_at=0.0,
        tier="gvisor",
        template="base",
        memory_mb=512,
        cpus=1.0,
        pids=256,
        file_size_mb=1024,
        open_files=1024,
        tmp_mb=256,
        memory=True,
        filesystem_sha256="",
        filesystem_bytes=0,
        filesystem_raw_bytes=0,
        context_saved=False,
        context_skipped=(),
        env_names=(),
    )
    with pytest.raises(TemplateMismatch, match="before sandbox images were recorded"):
        image_of(engine, m)


def test_shape_key_includes_the_image():
    t = Template(name="base")
    assert shape_key("container", t, Limits(), "sha256:1") != shape_key("container", t, Limits(), "sha256:2")
    assert shape_key("container", t, Limits(), "sha256:1") == shape_key("container", t, Limits(), "sha256:1")


def test_rows_record_the_image_and_template_users(engine, cache, tmp_path):
    reg = engine.registry
    d1 = _layer(cache, tmp_path, "v1")
    v1 = _add(engine, "app", (d1,))
    v2 = _add(engine, "app", (_layer(cache, tmp_path, "v2"),))
    rt = tmp_path / "rt"
    for sid, ver, img, pool in (
        ("sb-00000000000a", v1.version, v1.image_id, ""),
        ("sb-00000000000b", v2.version, v2.image_id, "p1"),
        ("sb-00000000000c", v2.version, v2.image_id, ""),
    ):
        reg.sandboxes.allocate(
            sid,
            "container",
            "app",
            60,
            Limits(),
            str(rt / sid),
            str(rt / sid / "s"),
            pool=pool,
            template_version=ver,
            image_id=img,
        )
    from warmbox.models import State

    reg.sandboxes.set_state("sb-00000000000b", State.POOLED, "warmed", expected=State.CREATING)
    reg.sandboxes.set_state("sb-00000000000c", State.DESTROYED, "gone")
    reg.usage.finalize("sb-00000000000c")
    reg.snapshots.add_snapshot("snap-c", "sb-00000000000c", time.time(), 10)
    info, _ = reg.sandboxes.get("sb-00000000000a")
    assert (info.template_version, info.image_id) == (v1.version, v1.image_id)
    assert resolve.template_users(engine, "app", v1.version) == ["sb-00000000000a"]
    assert resolve.template_users(engine, "app", v2.version) == ["sb-00000000000b", "p1", "snap-c"]
    assert resolve.template_users(engine, "app") == ["sb-00000000000a", "sb-00000000000b", "p1", "snap-c"]
    assert resolve.template_users(engine, "other") == []
    assert resolve.template_users(engine, "app", tenant=Tenant("alice")) == []
    row = reg.db.read("SELECT image_id FROM snapshots WHERE snapshot_id='snap-c'")
    assert row[0] == v2.image_id
    for sid in ("sb-00000000000a", "sb-00000000000b"):
        reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
        reg.usage.finalize(sid)


def test_manifest_records_the_image_and_reads_old_ones(tmp_path):
    from warmbox.storage.objects import LocalObjectStore

    store = LocalObjectStore(tmp_path / "objects")
    work = tmp_path / "work"
    work.mkdir()
    m = snaps.SnapshotManifest(
        snapshot_id="snap-abc",
        sandbox_id="sb-000000000000",
        parent="",
        created_at=1.0,
        tier="container",
        template="app",
        memory_mb=512,
        cpus=1.0,
        pids=256,
        file_size_mb=1024,
        open_files=1024,
        tmp_mb=256,
        memory=False,
        filesystem_sha256="ab",
        filesystem_bytes=1,
        filesystem_raw_bytes=1,
        context_saved=False,
        context_skipped=(),
        env_names=(),
        image_id="sha256:" + "1" * 64,
        template_version=3,
    )
    snaps.save_manifest(store, m, work)
    assert snaps.load_manifest(store, "snap-abc", work) == m
    raw = dataclasses.asdict(m)
    del raw["image_id"], raw["template_version"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    store.put_file(snaps.manifest_key("snap-abc"), tmp_path / "old.json")
    old = snaps.load_manifest(store, "snap-abc", work)
    assert (old.image_id, old.template_version) == ("", 0)
