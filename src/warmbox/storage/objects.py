"""Object store: where snapshot artifacts live. One small interface, a local-directory default.

Keys are ``/``-separated names (``blobs/sha256/<hex>``, ``snapshots/<id>.json``). A write is
visible only once complete (temp file + fsync + rename), so a reader never sees half an object;
a snapshot becomes visible only when its manifest, written last, exists.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO, Protocol

from warmbox.errors import ArtifactCorrupt, StorageError, StorageFull

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


def check_key(key: str) -> str:
    if not isinstance(key, str) or len(key) > 512 or not _KEY.match(key):
        raise StorageError(f"invalid object key {key!r}")
    return key


class ObjectStore(Protocol):
    """What snapshots need from a store. Files, not bytes, so artifacts never sit in memory."""

    def put_file(self, key: str, path: Path) -> None:
        """Store ``path``'s bytes under ``key``, atomically (a reader sees all or nothing)."""
        ...

    def get_file(self, key: str, dest: Path) -> None:
        """Write the object to ``dest``; ArtifactCorrupt if it does not exist."""
        ...

    def get_bounded(self, key: str, out: BinaryIO, max_bytes: int) -> int:
        """Write the object into ``out``; its byte count. ArtifactCorrupt if it does not exist or
        holds more than ``max_bytes`` (nothing past the bound is read)."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]: ...

    def modified(self, key: str) -> float:
        """Unix time the object was written."""
        ...

    def describe(self) -> str: ...


def _translate(e: OSError, what: str) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: no space left on the object store ({e.strerror})")
    return StorageError(f"{what}: {e.strerror or e}")


def _copy_bounded(chunks, out: BinaryIO, key: str, max_bytes: int) -> int:
    n = 0
    for chunk in chunks:
        n += len(chunk)
        if n > max_bytes:
            raise ArtifactCorrupt(f"object {key} holds more than {max_bytes} bytes")
        out.write(chunk)
    return n


def open_store(url: str) -> ObjectStore:
    """The store an object-store URL names: ``s3://bucket[/prefix]`` (endpoint from
    WARMBOX_S3_ENDPOINT), else a local directory path."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[5:].partition("/")
        return S3ObjectStore(bucket, prefix, endpoint_url=os.environ.get("WARMBOX_S3_ENDPOINT") or None)
    if not url:
        raise StorageError("no object store configured")
    return LocalObjectStore(Path(url))


class LocalObjectStore:
    """A directory (the embedded default: ``$WARMBOX_HOME/objects``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return f"local directory {self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        tmp = dest.parent / f".tmp-{dest.name}-{secrets.token_hex(4)}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(path, "rb") as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, dest)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _translate(e, f"writing {key}") from None

    def move_file(self, key: str, path: Path) -> None:
        """put_file by rename when ``path`` is on the store's filesystem (fsync'd first)."""
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(path, dest)
        except OSError as e:
            if e.errno == errno.EXDEV:
                return self.put_file(key, path)
            raise _translate(e, f"writing {key}") from None

    def get_file(self, key: str, dest: Path) -> None:
        try:
            shutil.copyfile(self._path(key), dest)
        except FileNotFoundError:
            raise ArtifactCorrupt(f"object {key} is missing from {self.describe()}") from None
        except OSError as e:
            raise _translate(e, f"reading {key}") from None

    def get_bounded(self, key: str, out: BinaryIO, max_bytes: int) -> int:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArtifactCorrupt(f"object {key} is missing from {self.describe()}") from None
        except OSError as e:
            raise _translate(e, f"reading {key}") from None
        with os.fdopen(fd, "rb") as src:
            return _copy_bounded(iter(lambda: src.read(1 << 20), b""), out, key, max_bytes)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _translate(e, f"deleting {key}") from None

    def modified(self, key: str) -> float:
        try:
            return self._path(key).stat().st_mtime
        except OSError as e:
            raise _translate(e, f"stat {key}") from None

    def list(self, prefix: str) -> list[str]:
        base = self.root
        out = []
        start = base / prefix if prefix else base
        if not start.exists():
            return []
        for p in start.rglob("*"):
            if p.is_file() and not p.name.startswith(".tmp-"):
                out.append(str(p.relative_to(base)))
        return sorted(out)

    def clean_partial(self) -> int:
        """Remove temp files of writes that never completed (a writer killed mid-put)."""
        n = 0
        if self.root.exists():
            for p in self.root.rglob(".tmp-*"):
                try:
                    p.unlink()
                    n += 1
                except OSError:
                    pass
        return n


class S3ObjectStore:
    """Any S3-API store (boto3): ``put`` is one PutObject/multipart upload, visible when complete."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None
    ) -> None:
        try:
            import boto3
        except ImportError:
            raise StorageError("the S3 object store needs boto3 (pip install boto3)") from None
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1")

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def _k(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, e: Exception, what: str) -> Exception:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "") if hasattr(e, "response") else ""
        if code in ("NoSuchKey", "404", "NotFound"):
            return ArtifactCorrupt(f"object {what} is missing from {self.describe()}")
        return StorageError(f"{what} on {self.describe()}: {type(e).__name__}: {e}")

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._s3.upload_file(str(path), self.bucket, self._k(key))
        except Exception as e:  # botocore's error tree, translated at this edge
            raise self._err(e, key) from None

    def get_file(self, key: str, dest: Path) -> None:
        try:
            self._s3.download_file(self.bucket, self._k(key), str(dest))
        except Exception as e:
            raise self._err(e, key) from None

    def get_bounded(self, key: str, out: BinaryIO, max_bytes: int) -> int:
        try:
            got = self._s3.get_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            raise self._err(e, key) from None
        body = got["Body"]
        try:
            if int(got.get("ContentLength") or 0) > max_bytes:
                raise ArtifactCorrupt(f"object {key} holds {got['ContentLength']} bytes, more than {max_bytes}")
            return _copy_bounded(body.iter_chunks(1 << 20), out, key, max_bytes)
        except (ArtifactCorrupt, OSError):
            raise
        except Exception as e:  # a connection cut mid-body
            raise self._err(e, key) from None
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except Exception as e:
            err = self._err(e, key)
            if isinstance(err, ArtifactCorrupt):
                return False
            raise err from None

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            raise self._err(e, key) from None

    def modified(self, key: str) -> float:
        try:
            return self._s3.head_object(Bucket=self.bucket, Key=self._k(key))["LastModified"].timestamp()
        except Exception as e:
            raise self._err(e, key) from None

    def list(self, prefix: str) -> list[str]:
        out = []
        full = self._k(prefix) if prefix else self.prefix
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    k = obj["Key"]
                    out.append(k[len(self.prefix) + 1 :] if self.prefix else k)
        except Exception as e:
            raise self._err(e, prefix) from None
        return sorted(out)
