"""Attack: whoever can write the cluster's object store (or a corrupt copy in it) serves a node
template layers. A node fetching a layer it lacks reads at most a bound, re-hashes the bytes
against the digest its registry recorded, and unpacks them as hostile; nothing it refused stays in
its layer store. Real S3 API (moto's server on loopback), real layer stores, and two cluster
nodes on this host: one builds, the other creates a sandbox from the tampered template."""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import layershare
from tests.engine.conftest import NodeHomes
from tests.s3server import BUCKET
from warmbox import CorruptLayer, Sandbox
from warmbox.engine import images
from warmbox.errors import InvalidArgument, TemplateError
from warmbox.models import State
from warmbox.storage import templates
from warmbox.storage.layers import LayerStore
from warmbox.storage.objects import S3ObjectStore

pytestmark = pytest.mark.sandbox


@pytest.fixture
def node_homes() -> Iterator[NodeHomes]:
    homes = NodeHomes()
    try:
        yield homes
    finally:
        homes.close()


@pytest.fixture
def cache_b():
    yield from layershare.node_cache()


@pytest.fixture
def shared(s3_server, monkeypatch, cache_b):
    yield from layershare.shared_store(s3_server, monkeypatch)


@pytest.fixture
def objects(s3_server, monkeypatch) -> S3ObjectStore:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return S3ObjectStore(BUCKET, f"atk-{secrets.token_hex(4)}", endpoint_url=s3_server.url)


def tar_blob(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def left_in(store: LayerStore) -> list[str]:
    """What a refused fetch must not leave: blobs, unpacked dirs, work files."""
    return [
        *(f"blob {n}" for n in os.listdir(store.blobs)),
        *(f"dir {n}" for n in os.listdir(store.dirs)),
        *(f"tmp {n}" for n in os.listdir(store.tmp)),
    ]


def test_a_tampered_layer_in_the_object_store_is_refused_on_another_node(
    shared, node_homes, monkeypatch, cache_b, runc_ready
):
    a = node_homes.add("a")
    b = node_homes.add("b", share=a)
    builtin = shared.seed_builtin(cache_b)
    token = secrets.token_hex(8)
    info = layershare.build(a, f"t-tamper-{os.getpid()}", token)
    own = [d for d in info.layers if d not in builtin]
    target = own[-1]
    # the attacker swaps the layer's object for one of the same size whose file says something else
    genuine = (images.store().blobs / target[7:]).read_bytes()
    assert token.encode() in genuine
    evil = Path(cache_b) / "evil"
    evil.write_bytes(genuine.replace(token.encode(), secrets.token_hex(8).encode()))
    shared.objects.put_file(templates.layer_key(target), evil)
    evil.unlink()

    monkeypatch.setenv("WARMBOX_IMAGE_CACHE", str(cache_b))  # node b's host
    with pytest.raises(CorruptLayer) as e:
        Sandbox.create(template=info.name, tier="container", timeout=60, pool=False, home=b.home)
    assert e.value.value == target and "hashes to" in str(e.value)
    b_store = LayerStore(cache_b)
    assert not b_store.has(target) and not (b_store.dirs / target[7:]).exists()
    assert [n for n in os.listdir(b_store.tmp) if n.startswith("fetch-")] == []
    started = [
        i for i, _ in b.registry.sandboxes.list(include_pooled=True, local=True) if i.state is not State.DESTROYED
    ]
    assert started == []  # refused before any sandbox of b started


@pytest.mark.parametrize("how", ["tampered", "missing", "oversized"])
def test_a_layer_object_that_is_not_its_digest_is_refused_and_nothing_stays(objects, tmp_path, how):
    a, b = LayerStore(tmp_path / "a"), LayerStore(tmp_path / "b")
    src = tmp_path / "layer"
    src.write_bytes(tar_blob({"etc/data": b"genuine\n" * 100}))
    d = a.add_blob(src).digest
    templates.share_layers(objects, a, [d])
    key = templates.layer_key(d)
    bad = tmp_path / "bad"
    if how == "tampered":  # same size, one member's bytes changed
        bad.write_bytes(tar_blob({"etc/data": b"genuinE\n" * 100}))
        objects.put_file(key, bad)
    elif how == "missing":
        objects.delete(key)
    else:  # more than the bound: refused while streaming, never written past it
        bad.write_bytes(os.urandom(300_000))
        objects.put_file(key, bad)
    with pytest.raises(CorruptLayer) as e:
        templates.fetch_layer(objects, b, d, max_bytes=200_000)
    assert e.value.value == d
    assert {"tampered": "hashes to", "missing": "missing", "oversized": "more than 200000"}[how] in str(e.value)
    assert not b.has(d) and left_in(b) == []


def test_a_hostile_archive_stored_under_its_own_digest_is_refused(objects, tmp_path):
    """The bytes match the key (the attacker chose the key), but the archive climbs out of the
    layer: unpacked as hostile, refused, nothing kept."""
    b = LayerStore(tmp_path / "b")
    blob = tar_blob({"../../../../tmp/escaped-by-a-layer": b"x\n"})
    d = "sha256:" + hashlib.sha256(blob).hexdigest()
    path = tmp_path / "hostile"
    path.write_bytes(blob)
    objects.put_file(templates.layer_key(d), path)
    with pytest.raises(TemplateError):
        templates.fetch_layers(objects, b, [d])
    assert not Path("/tmp/escaped-by-a-layer").exists()
    assert not b.has(d) and left_in(b) == []


def test_layer_keys_are_digests_only():
    for bad in ("sha256:../../etc", "sha256:" + "A" * 64, "layers/x", ""):
        with pytest.raises(InvalidArgument):
            templates.layer_key(bad)
    assert templates.layer_key("sha256:" + "a" * 64) == "layers/sha256/" + "a" * 64
