"""Request checks: the front's validators of single request fields (typed InvalidArgument, nothing else)."""

from __future__ import annotations

import collections.abc
from typing import Any

from warmbox.errors import InvalidArgument, SandboxNotFound
from warmbox.models import SnapshotRef, validate_timeout


def optional_timeout(timeout: float | None, name: str = "timeout") -> float:
    """Seconds, or 0.0 for None/0 (no bound)."""
    return 0.0 if timeout is None or timeout == 0 else validate_timeout(timeout, name)


def positive_int(value: object, name: str, unit: str = "bytes") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive number of {unit}, got {value!r}")
    return value


def argv(cmd: object) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("cmd must not be empty")
        out = ["/bin/bash", "-c", cmd]
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        out = list(cmd)
    else:
        raise InvalidArgument("cmd must be a non-empty string or list of strings")
    if any("\0" in a for a in out):
        raise InvalidArgument("cmd must not contain NUL bytes")
    return out


def pid(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 < value < 1 << 31:
        raise InvalidArgument(f"pid must be a process id (an integer above 1), got {value!r}")
    return value


def size(value: object, name: str, zero: bool = False) -> int:
    """A terminal's columns or rows (1..9999; 0 too when ``zero``: no terminal)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (0 if zero else 1) <= value <= 9999:
        raise InvalidArgument(f"{name} must be an integer from {0 if zero else 1} to 9999, got {value!r}")
    return value


def template_name(name: object) -> str:
    from warmbox.templates import check_name

    return check_name(name)


def version(version: object) -> int | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidArgument(f"version must be a positive integer, got {version!r}")
    return version


def epoch(value: object, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise InvalidArgument(f"{name} must be a time in epoch seconds, got {value!r}")
    return float(value)


def snapshot_ref(m: Any) -> SnapshotRef:
    return SnapshotRef(
        snapshot_id=m.snapshot_id,
        sandbox_id=m.sandbox_id,
        created_at=m.created_at,
        tier=m.tier,
        template=m.template,
        memory=m.memory,
        size_bytes=m.size_bytes,
        context_skipped=m.context_skipped,
        context_saved=m.context_saved,
        files_raw_bytes=m.filesystem_raw_bytes,
        files_bytes=m.filesystem_bytes,
    )


def file_bytes(data: object, name: str) -> bytes:
    """A file's contents as given to the files API: text (UTF-8) or bytes."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise InvalidArgument(f"{name} must be str or bytes, got {type(data).__name__}")


def check_mode(mode: object) -> None:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode must be a permission number from 0 to 0o7777, got {mode!r}")


async def checked_chunks(chunks: collections.abc.AsyncIterator[object]) -> collections.abc.AsyncIterator[bytes]:
    """A streamed write's chunks as bytes; anything else ends the write with InvalidArgument."""
    async for chunk in chunks:
        if isinstance(chunk, (bytes, bytearray, memoryview)):
            yield bytes(chunk)
        else:
            raise InvalidArgument(f"a streamed write's chunks must be bytes, got {type(chunk).__name__}")


def is_snapshot_id(ref: object) -> bool:
    """A well-formed snapshot id (what snapshots.resolve and delete accept as one)."""
    return isinstance(ref, str) and ref.startswith("snap-") and "/" not in ref


def unknown_snapshot(snapshot_id: str) -> SandboxNotFound:
    """To a tenant: a snapshot id that is not one of its own (unknown or another tenant's)."""
    return SandboxNotFound(f"no snapshot {snapshot_id}", snapshot_id)
