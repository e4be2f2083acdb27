"""Object stores: the local directory and the S3 API (a real S3-compatible server on loopback)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.s3server import BUCKET, CLIENT_ENV, S3Server
from warmbox import ArtifactCorrupt, Sandbox, StorageError
from warmbox.storage.objects import LocalObjectStore, S3ObjectStore


@pytest.fixture(scope="module")
def s3_endpoint(s3_server: S3Server):
    """The session's moto S3 server (tests/s3server.py), its fake credentials in os.environ for
    this module (the engine's S3 store reads them from there)."""
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


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    return S3ObjectStore(BUCKET, f"t-{os.urandom(4).hex()}", endpoint_url=request.getfixturevalue("s3_endpoint"))


def test_store_contract(store, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(os.urandom(300_000))
    store.put_file("blobs/sha256/abc", src)
    assert store.exists("blobs/sha256/abc") and not store.exists("blobs/sha256/nope")
    out = tmp_path / "out"
    store.get_file("blobs/sha256/abc", out)
    assert out.read_bytes() == src.read_bytes()
    assert store.list("blobs") == ["blobs/sha256/abc"]
    assert time.time() - store.modified("blobs/sha256/abc") < 120
    with pytest.raises(ArtifactCorrupt):
        store.get_file("blobs/sha256/nope", out)
    for bad in ("../etc/passwd", "/abs", "a//b", "", "a/../b"):
        with pytest.raises(StorageError):
            store.put_file(bad, src)
    store.delete("blobs/sha256/abc")
    assert not store.exists("blobs/sha256/abc") and store.list("blobs") == []
    if isinstance(store, LocalObjectStore):  # writes are temp + rename: nothing partial is listed
        assert not list(store.root.rglob(".tmp-*"))


@pytest.mark.sandbox
def test_snapshot_round_trip_through_s3(home, runc_ready, s3_endpoint):
    old = {k: os.environ.get(k) for k in ("WARMBOX_OBJECT_STORE", "WARMBOX_S3_ENDPOINT")}
    os.environ["WARMBOX_OBJECT_STORE"] = f"s3://{BUCKET}/snaps-{os.urandom(3).hex()}"
    os.environ["WARMBOX_S3_ENDPOINT"] = s3_endpoint
    try:
        with Sandbox.create(timeout=60, template="base") as sb:
            sb.files.write("/workspace/s3.txt", "via s3")
            sb.run_code("answer = 42")
            ref = sb.pause()
        with Sandbox.resume(ref) as back:
            assert back.files.read("/workspace/s3.txt") == "via s3"
            assert back.run_code("answer").text == "42"
        from warmbox.engine import snapshot as snaps
        from warmbox.engine import snapstore
        from warmbox.engine.engine import Engine
        from warmbox.storage import snapshots as artifacts

        engine = Engine.for_home(home)
        m = snaps.resolve(engine, ref.snapshot_id)
        store = snapstore.store_for(engine)
        assert isinstance(store, S3ObjectStore)
        junk = Path(engine.home) / "junk"
        junk.write_bytes(b"\0" * m.filesystem_bytes)  # same size, wrong bytes
        store.put_file(artifacts.blob_key(m.filesystem_sha256), junk)
        junk.unlink()
        with pytest.raises(ArtifactCorrupt, match="checksum"):
            Sandbox.create(from_snapshot=ref)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
