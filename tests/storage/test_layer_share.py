"""Template layers shared through a cluster's object store (storage.templates: share_layers,
fetch_layers, collect_shared) on a real S3 API (moto's server on loopback) and real layer stores:
a blob uploaded once by one node's store is fetched, re-hashed and unpacked by another's; what a
registry's template versions no longer name goes after the grace period. (Refusals of bad
objects: tests/attacks/test_shared_layers.py.)"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

import pytest

from tests.s3server import BUCKET, CLIENT_ENV, S3Server
from warmbox.models import TemplateInfo
from warmbox.storage import templates
from warmbox.storage.layers import LayerStore
from warmbox.storage.objects import S3ObjectStore
from warmbox.storage.registry import Registry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers are unpacked as root (owners)")


@pytest.fixture(scope="module")
def s3_endpoint(s3_server: S3Server):
    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    os.environ.update(CLIENT_ENV)
    try:
        yield s3_server.url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def objects(s3_endpoint: str) -> S3ObjectStore:
    return S3ObjectStore(BUCKET, f"ls-{os.urandom(4).hex()}", endpoint_url=s3_endpoint)


def tar_blob(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def add(store: LayerStore, tmp: Path, files: dict[str, bytes]) -> str:
    path = tmp / f"blob-{os.urandom(4).hex()}"
    path.write_bytes(tar_blob(files))
    return store.add_blob(path).digest


def test_a_layer_shared_by_one_store_is_fetched_verified_and_unpacked_by_another(objects, tmp_path):
    a, b = LayerStore(tmp_path / "a"), LayerStore(tmp_path / "b")
    d1 = add(a, tmp_path, {"etc/one": b"first layer\n"})
    d2 = add(a, tmp_path, {"etc/two": b"second layer\n" * 1000})
    assert templates.share_layers(objects, a, [d1, d2, d1]) == [d1, d2]
    assert objects.list(templates.LAYER_PREFIX) == sorted(templates.layer_key(d) for d in (d1, d2))
    assert templates.share_layers(objects, a, [d1, d2]) == []  # create-once: already there
    assert templates.fetch_layers(objects, b, [d1, d2]) == [d1, d2]
    assert templates.fetch_layers(objects, b, [d1, d2]) == []  # present: nothing fetched
    for d in (d1, d2):
        blob = (b.blobs / d[7:]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == d[7:]
    assert (Path(b.get(d2).path) / "etc/two").read_bytes() == b"second layer\n" * 1000
    assert os.listdir(b.tmp) == []


def test_an_old_shared_blob_is_written_again_before_a_version_names_it(objects, tmp_path):
    a = LayerStore(tmp_path / "a")
    d = add(a, tmp_path, {"x": b"x"})
    templates.share_layers(objects, a, [d])
    # a blob older than half the grace could be taken by a gc before the new version is recorded
    assert templates.share_layers(objects, a, [d], grace_s=0.0) == [d]
    assert templates.share_layers(objects, a, [d], grace_s=3600.0) == []


def _version(name: str, layers: tuple[str, ...]) -> TemplateInfo:
    return TemplateInfo(
        name=name, version=0, image_id="sha256:" + hashlib.sha256(name.encode()).hexdigest(), layers=layers
    )


def test_gc_of_shared_blobs_keeps_what_any_version_names_and_young_blobs(objects, tmp_path):
    a = LayerStore(tmp_path / "a")
    used = add(a, tmp_path, {"used": b"u"})
    unused = add(a, tmp_path, {"unused": b"n"})
    templates.share_layers(objects, a, [used, unused])
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"not a layer")
    objects.put_file(f"{templates.LAYER_PREFIX}/README", foreign)  # not a digest: never touched
    reg = Registry(tmp_path / "registry.db", "n2")  # another node's view of the shared registry
    try:
        reg.templates.template_add(_version("t-kept", (used,)))
        assert templates.collect_shared(objects, reg) == []  # both younger than the grace
        assert templates.collect_shared(objects, reg, grace_s=0.0, dry_run=True) == [unused]
        assert objects.exists(templates.layer_key(unused))
        time.sleep(0.01)
        assert templates.collect_shared(objects, reg, grace_s=0.0) == [unused]
        assert not objects.exists(templates.layer_key(unused))
        assert objects.exists(templates.layer_key(used)) and objects.exists(f"{templates.LAYER_PREFIX}/README")
        reg.templates.template_delete("t-kept")
        assert templates.collect_shared(objects, reg, grace_s=0.0) == [used]
    finally:
        reg.close()
