"""Object stores: the local directory and the S3 API (a real S3-compatible server on loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmbox import ArtifactCorrupt, Sandbox, StorageError
from warmbox.storage.objects import LocalObjectStore, S3ObjectStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 only; fake credentials; no metadata-service lookups."""
    port = _free_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_EC2_METADATA_DISABLED",
            "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE",
        )
    }
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        }
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError as e:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from e
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="wb-test")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    return S3ObjectStore("wb-test", f"t-{os.urandom(4).hex()}", endpoint_url=request.getfixturevalue("s3_endpoint"))


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
    os.environ["WARMBOX_OBJECT_STORE"] = f"s3://wb-test/snaps-{os.urandom(3).hex()}"
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
        from warmbox.engine.engine import Engine
        from warmbox.storage import snapshots as artifacts

        engine = Engine.for_home(home)
        m = snaps.resolve(engine, ref.snapshot_id)
        store = snaps.store_for(engine)
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
