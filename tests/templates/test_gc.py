"""`warmbox template gc`: layers of removed templates go, those of other templates, of the
built-in image and of an image a snapshot recorded stay; the microVM root of a removed template's
image goes. A temporary image cache (WARMBOX_IMAGE_CACHE): gc never touches the host's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox import operations as ops
from warmbox.backends import microvm_image
from warmbox.engine import images, resolve, teardown
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import TemplateInUse, TemplateNotFound
from warmbox.storage import oci
from warmbox.templates import Template

pytestmark = pytest.mark.sandbox
TOKEN = secrets.token_hex(6)


def _run(engine: Engine, request):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        front = EngineFront(engine)
        try:
            return await front.handle(request)
        finally:
            await front.close()

    return asyncio.run(go())


def _root(cache: Path, image_id: str) -> Path:
    """A microVM root file as image_root names it (made without booting: gc works on the names)."""
    path = cache / microvm_image.ROOTS / f"{image_id.removeprefix('sha256:')[:32]}-{microvm_image.agent_hash()}.ext4"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    return path


@pytest.fixture
def gc_home(runc_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home of its own (no pools) over a temporary image cache: its daemon inherits that cache
    (the session home's daemon must never run with it: it would build the built-in image there)."""
    from warmbox.engine.daemon import down_home

    monkeypatch.setenv("WARMBOX_IMAGE_CACHE", str(tmp_path / "images"))
    path = Path(f"/tmp/wbgc-{secrets.token_hex(3)}")
    path.mkdir(mode=0o700)
    (path / "warmbox.toml").write_text("[daemon]\nidle_exit = 3\n\n[pools]\n")  # no pool: no built-in image
    try:
        yield path
    finally:
        engine = Engine.for_home(path)
        asyncio.run(down_home(path))
        live = engine.list()
        for info in live:
            asyncio.run(teardown.destroy(engine, info.sandbox_id, "test teardown"))
        shutil.rmtree(engine.runtime, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        assert not live, f"left live sandboxes: {[i.sandbox_id for i in live]}"


def test_gc_after_rm_keeps_others_and_snapshot_images(gc_home: Path, oci_archive: Path, tmp_path: Path):
    cache = tmp_path / "images"
    engine = Engine.for_home(gc_home)
    store = images.store()
    # a built-in image record naming layers of its own (the OCI image's): gc must keep them
    base = oci.import_oci(store, oci_archive)
    builtin_layers = [layer.digest for layer in base.layers]
    (cache / "builtin-test.json").write_text(
        json.dumps(
            {
                "key": "builtin-test",
                "image_id": "sha256:" + "b" * 64,
                "layers": builtin_layers,
                "built_at": time.time(),
                "build_s": 1.0,
            }
        )
    )
    names = {k: f"gc-{os.getpid()}-{k}" for k in ("gone", "other", "snap")}
    specs = {k: Template.from_oci(str(oci_archive)).run(f"echo {k} {TOKEN} > /srv/{k}") for k in names}
    infos = {k: _run(engine, ops.TemplateBuild(n, specs[k], None)) for k, n in names.items()}
    own = {k: set(i.layers) - set(builtin_layers) for k, i in infos.items()}
    assert all(own.values()) and not (own["gone"] & own["other"]) and not (own["gone"] & own["snap"])
    roots = {k: _root(cache, i.image_id) for k, i in infos.items()}
    sid = ""
    try:
        made = _run(engine, ops.Create(template=names["snap"], pool=False, timeout=120))
        sid = made.info.sandbox_id
        _run(engine, ops.Snapshot(sid))
        _run(engine, ops.Kill(sid))
        with pytest.raises(TemplateInUse):
            _run(engine, ops.TemplateDelete(names["snap"]))
        _run(engine, ops.TemplateDelete(names["gone"]))

        from tests.conftest import cli

        r = cli("template", "gc", "--dry-run", env={"WARMBOX_HOME": str(gc_home)})
        assert r.returncode == 0, r.stderr
        assert all(f"would remove layer {d}" in r.stdout for d in own["gone"]), r.stdout
        assert f"would remove microVM root {roots['gone'].name}" in r.stdout and "MiB" in r.stdout
        dry = _run(engine, ops.TemplateGc(dry_run=True))
        assert dry.dry_run and own["gone"] <= set(dry.layers) and all(store.has(d) for d in dry.layers)
        rep = _run(engine, ops.TemplateGc())
        assert set(rep.layers) == set(dry.layers) and own["gone"] <= set(rep.layers), rep
        kept = own["other"] | own["snap"] | set(builtin_layers)
        assert not kept & set(rep.layers)
        assert all(store.has(d) for d in kept) and not any(store.has(d) for d in own["gone"])
        assert rep.roots == (roots["gone"].name,) and not roots["gone"].exists()
        assert roots["other"].exists() and roots["snap"].exists()
        assert rep.bytes_freed >= 1 << 20
        print(f"template gc freed {rep.bytes_freed} bytes: {len(rep.layers)} layer(s), {len(rep.roots)} root(s)")
        # the snapshot's recorded image still resolves (its layers are all there)
        info = engine.registry.templates.template_get(names["snap"], None, "")
        assert resolve.recorded_image(engine, names["snap"], info.version, info.image_id).layers
        # an older guest agent's root of a kept image goes too
        stale = roots["other"].with_name(roots["other"].name.rsplit("-", 1)[0] + "-" + "0" * 16 + ".ext4")
        stale.write_bytes(b"x")
        assert stale.name in _run(engine, ops.TemplateGc()).roots and not stale.exists()
    finally:
        for snap in engine.registry.snapshots.snapshots_of(sid) if sid else []:
            with contextlib.suppress(Exception):
                _run(engine, ops.DeleteSnapshot(snap))
        for n in names.values():
            with contextlib.suppress(TemplateNotFound):
                _run(engine, ops.TemplateDelete(n))
        _run(engine, ops.TemplateGc())
