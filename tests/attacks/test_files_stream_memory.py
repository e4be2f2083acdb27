"""Large files do not cost host memory: a 200 MB streamed write and read keep the peak RSS of the
host processes (the caller with its in-process engine, or the client and the API server) small."""

from __future__ import annotations

import hashlib
import os

import pytest

from warmbox import Sandbox

pytestmark = pytest.mark.sandbox

SIZE_MB = 200
BOUND_MB = 64  # peak RSS growth allowed while 200 MB go through


def _peak_reset(pid: int | str = "self") -> None:
    """Start a new peak-RSS measurement (VmHWM) of a process."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _mb(pid: int | str, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class _Source:
    """200 MB of chunks made on the fly (1 MiB each, each different), hashed as they are taken."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self._seed = os.urandom(1 << 20)

    def __iter__(self):
        for i in range(SIZE_MB):
            chunk = i.to_bytes(8, "big") + self._seed[8:]
            self.sha.update(chunk)
            yield chunk


def _round_trip(sb, pids: dict[str, int | str]) -> dict[str, float]:
    """Write then read 200 MB as streams; the peak RSS growth of each of ``pids``, in MB."""
    source = _Source()
    for pid in pids.values():
        _peak_reset(pid)
    base = {name: _mb(pid, "VmRSS") for name, pid in pids.items()}
    entry = sb.files.write("big.bin", source)
    assert entry.size == SIZE_MB << 20
    r = sb.commands.run("sha256sum /workspace/big.bin")
    assert r.stdout.split()[0] == source.sha.hexdigest()
    got = hashlib.sha256()
    n = 0
    for chunk in sb.files.read("big.bin", format="stream", max_bytes=SIZE_MB << 20):
        got.update(chunk)
        n += len(chunk)
    assert (n, got.hexdigest()) == (SIZE_MB << 20, source.sha.hexdigest())
    return {name: _mb(pid, "VmHWM") - base[name] for name, pid in pids.items()}


def test_a_200mb_streamed_write_and_read_in_process_keep_host_memory_small(home, runc_ready):
    with Sandbox.create(tier="container", timeout=300, home=home) as sb:
        growth = _round_trip(sb, {"caller": "self"})
    print("growth MB", growth)
    assert growth["caller"] < BOUND_MB, growth


def test_a_200mb_streamed_write_and_read_over_http_keep_client_and_server_memory_small(api_server, runc_ready):
    env = api_server.client_env
    with Sandbox.create(
        tier="container", timeout=300, api_url=env["WARMBOX_API_URL"], api_key=env["WARMBOX_API_KEY"]
    ) as sb:
        growth = _round_trip(sb, {"client": "self", "server": api_server.proc.pid})
    print("growth MB", growth)
    assert growth["client"] < BOUND_MB and growth["server"] < BOUND_MB, growth
