"""files.read is bounded on the host: a hostile sandbox user cannot make the SDK process buffer
without limit or hang, nor keep the agent working for a reader that stopped.

Red-team finding: ``ln -sf /dev/zero /workspace/out.csv`` then ``files.read`` grew the SDK
process until the OOM killer ended it; a FIFO blocked the read forever; a 1 GiB file peaked at
~2 GiB; after the client went away the agent kept reading /dev/zero at full CPU.
Memory is this process's peak resident set (VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time

import pytest

from tests.attacks.conftest import scripted_agent
from tests.conftest import wait_for
from warmbox import InvalidArgument, Sandbox, SandboxTimeout
from warmbox import protocol as p
from warmbox.engine.engine import Engine
from warmbox.engine.guest_client import READ_WINDOW, GuestClient
from warmbox.errors import FileTooLarge, GuestProtocolError, NotARegularFile

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

MiB = 1 << 20
SMALL = 32 * MiB  # what a refused or streamed read may add to this process's peak memory at most
TICK = os.sysconf("SC_CLK_TCK")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/self/status")


class PeakGrowth:
    """How far this process's resident memory rose above its level at the start of the block."""

    def __enter__(self) -> PeakGrowth:
        gc.collect()
        self._stop = threading.Event()
        self._sampler = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS; the kernel tracks the peak from here
        except OSError:  # no resettable peak here: sample VmRSS instead
            self._peak = 0
            self._sampler = threading.Thread(target=self._sample, daemon=True)
        self.base = _status_kib("VmRSS")
        if self._sampler is not None:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _status_kib("VmRSS"))

    @property
    def bytes(self) -> int:
        peak = max(self._peak, _status_kib("VmRSS")) if self._sampler is not None else _status_kib("VmHWM")
        return (peak - self.base) * 1024

    def __exit__(self, *exc: object) -> None:
        self.growth = self.bytes
        self._stop.set()


def sh(sb, cmd: str) -> str:
    r = sb.commands.run(cmd, timeout=30)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


# Who holds a file open, seen from inside (the agent is not dumpable: its /proc/1/fd is closed
# to the sandbox's user): inotify reports every open and close of the file.
_WATCH = r"""
import ctypes, os, struct, sys
path, log = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_OPEN = 0x08, 0x10, 0x20
if fd < 0 or libc.inotify_add_watch(fd, path.encode(), IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | IN_OPEN) < 0:
    sys.exit("inotify: errno %d" % ctypes.get_errno())
with open(log, "a", buffering=1) as out:
    out.write("ready\n")
    while True:
        buf = os.read(fd, 65536)
        off = 0
        while off < len(buf):
            _, mask, _, n = struct.unpack_from("iIII", buf, off)
            off += 16 + n
            out.write("open\n" if mask & IN_OPEN else "close\n")
"""


class OpenWatch:
    """Opens minus closes of one file in the sandbox since the watch started."""

    def __init__(self, sb, path: str) -> None:
        self.sb = sb
        self.log = f"/tmp/watch-{os.path.basename(path)}.log"
        sb.files.write("/tmp/watch.py", _WATCH)
        sh(sb, f"setsid python3 /tmp/watch.py {path} {self.log} </dev/null >/dev/null 2>&1 &")
        wait_for(lambda: "ready" in self._lines(), timeout=10, what="the inotify watch")

    def _lines(self) -> list[str]:
        return sh(self.sb, f"cat {self.log} 2>/dev/null || true").split()

    @property
    def held(self) -> int:
        lines = self._lines()
        return lines.count("open") - lines.count("close")

    @property
    def opens(self) -> int:
        return self._lines().count("open")


def agent_cpu_s(sb) -> float:
    raw = sh(sb, "cat /proc/1/stat")
    fields = raw[raw.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def assert_agent_idle(sb, watch: OpenWatch, over_s: float = 1.5) -> None:
    """The agent let go of the file and burns no CPU (a read it kept going would use ~a core)."""
    assert watch.opens >= 1, "the watch saw no read of the file at all"
    wait_for(lambda: watch.held == 0, timeout=5, what="the agent to close the file")
    before = agent_cpu_s(sb)
    time.sleep(over_s)
    used = agent_cpu_s(sb) - before
    assert used < 0.25, f"the agent used {used:.2f} s of CPU in {over_s} s after the read ended"


def test_symlink_to_dev_zero_is_refused_without_reading(tier):
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sh(sb, "ln -sf /dev/zero /workspace/out.csv")
        for fmt in ("text", "bytes", "stream"):
            t0 = time.monotonic()
            with PeakGrowth() as mem:
                with pytest.raises(NotARegularFile):
                    # a cap far above anything this host holds: the refusal is about the kind of file
                    sb.files.read("/workspace/out.csv", format=fmt, max_bytes=1 << 40, timeout=10)
            assert time.monotonic() - t0 < 3
            assert mem.growth < SMALL, f"{fmt}: the SDK process grew {mem.growth >> 20} MiB"
        with pytest.raises(NotARegularFile):
            sb.files.read("/dev/zero", format="bytes")
        sb.files.write("/workspace/real.txt", "real")  # a symlink to a regular file is fine
        sh(sb, "ln -sf /workspace/real.txt /workspace/link.txt")
        assert sb.files.read("/workspace/link.txt") == "real"


def test_fifo_and_socket_are_refused_without_blocking(tier):
    with Sandbox.create(tier=tier, timeout=300) as sb:
        # the socket in /tmp: gVisor refuses even a stat of a socket bound on /workspace (EPERM)
        sh(
            sb,
            "mkfifo /workspace/fifo && ln -s /workspace/fifo /workspace/via-link && python3 -c "
            "\"import socket; socket.socket(socket.AF_UNIX).bind('/tmp/sock')\"",
        )
        for path in ("/workspace/fifo", "/workspace/via-link", "/tmp/sock"):
            t0 = time.monotonic()
            with pytest.raises(NotARegularFile):
                sb.files.read(path, timeout=10)  # a blocked open would end in SandboxTimeout instead
            assert time.monotonic() - t0 < 3, path
        assert sb.commands.run("echo alive").stdout == "alive\n"  # nothing of the agent is stuck


def test_large_file_is_refused_by_default_and_streams_in_bounded_memory(tier):
    size = 150 * MiB
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sh(sb, f"truncate -s {size} /workspace/big")  # sparse: no disk used
        t0 = time.monotonic()
        with PeakGrowth() as mem:
            with pytest.raises(FileTooLarge):
                sb.files.read("/workspace/big")  # default max_bytes: 100 MiB
        assert time.monotonic() - t0 < 3 and mem.growth < SMALL, "refused up front, nothing read"

        with PeakGrowth() as mem:
            total = zeros = 0
            with sb.files.read("/workspace/big", format="stream", max_bytes=200 * MiB) as stream:
                for chunk in stream:
                    assert isinstance(chunk, bytes) and 0 < len(chunk) <= p.CHUNK
                    total += len(chunk)
                    zeros += chunk.count(0)
        assert total == zeros == size
        assert mem.growth < SMALL, f"a streamed read of 150 MiB grew the SDK process {mem.growth >> 20} MiB"

        # the same file read whole: the measurement sees the buffer, and it is held once, not twice
        with PeakGrowth() as mem:
            data = sb.files.read("/workspace/big", format="bytes", max_bytes=200 * MiB)
            assert len(data) == size and type(data) is bytes
            del data
        assert 0.9 * size < mem.growth < 1.5 * size, f"a whole read of 150 MiB peaked at +{mem.growth >> 20} MiB"


def test_slow_stream_reader_holds_a_window_and_an_abandoned_stream_stops(tier):
    size = 150 * MiB
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sh(sb, f"truncate -s {size} /workspace/big")
        watch = OpenWatch(sb, "/workspace/big")
        with PeakGrowth() as mem:
            stream = sb.files.read("/workspace/big", format="stream", max_bytes=size)
            assert 0 < len(next(stream)) <= p.CHUNK
            time.sleep(2)  # the sandbox sends ~100+ MiB/s: without flow control it would all be here
            held = mem.bytes
        assert held < SMALL, f"a reader that stopped taking chunks holds {held >> 20} MiB"
        assert watch.held == 1  # the read is still open, waiting for the reader...
        before = agent_cpu_s(sb)
        time.sleep(1)
        assert agent_cpu_s(sb) - before < 0.25  # ...without spinning
        stream.close()
        assert_agent_idle(sb, watch)
        assert stream.bytes_read < size and list(stream) == []

        dropped = sb.files.read("/workspace/big", format="stream", max_bytes=size)
        next(dropped)
        wait_for(lambda: watch.held == 1, timeout=5, what="the second read to open the file")
        del dropped  # never closed: dropping it stops the read too
        gc.collect()
        assert_agent_idle(sb, watch)


def test_timed_out_read_stops_in_the_sandbox(tier):
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sh(sb, "truncate -s 1000M /workspace/huge")
        watch = OpenWatch(sb, "/workspace/huge")
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeout):
            sb.files.read("/workspace/huge", format="bytes", max_bytes=1 << 40, timeout=0.3)
        assert time.monotonic() - t0 < 3
        assert_agent_idle(sb, watch)
        sb.files.write("/workspace/after.txt", "still served")
        assert sb.files.read("/workspace/after.txt", timeout=5) == "still served"


def test_reader_that_went_away_stops_the_agent(tier, home):
    """A client whose connection closed mid-read (its process died): the agent stops reading."""
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sh(sb, "truncate -s 1000M /workspace/huge")
        watch = OpenWatch(sb, "/workspace/huge")
        _, handle = Engine.for_home(home).info(sb.sandbox_id)

        async def read_one_chunk_then_vanish() -> None:
            client = await GuestClient.connect(handle.socket_path, sb.sandbox_id)
            reader = await client.read_file("/workspace/huge", max_bytes=1 << 40)
            assert isinstance(await reader.next(), p.Chunk)
            await client.close()  # no Cancel: the connection just ends

        asyncio.run(read_one_chunk_then_vanish())
        assert_agent_idle(sb, watch)


def test_file_longer_than_its_size_or_growing_fails_past_max_bytes(tier):
    with Sandbox.create(tier=tier, timeout=300) as sb:
        # /proc files report st_size 0: only the read itself can find out they are longer
        assert sb.files.get_info("/proc/1/status").size == 0
        status = sb.files.read("/proc/1/status")
        assert "Name:" in status and len(status) > 200
        for fmt in ("text", "bytes"):
            with pytest.raises(FileTooLarge, match="longer than max_bytes"):
                sb.files.read("/proc/1/status", format=fmt, max_bytes=200)

        limit = 4 * READ_WINDOW  # the sandbox stops a window ahead of this reader: well before the end
        sh(sb, f"truncate -s {limit} /workspace/grows")
        got = 0
        with sb.files.read("/workspace/grows", format="stream", max_bytes=limit) as stream:
            got += len(next(stream))
            sh(sb, f"truncate -s {4 * limit} /workspace/grows")  # it grows while it is read
            with pytest.raises(FileTooLarge, match="longer than max_bytes"):
                for chunk in stream:
                    got += len(chunk)
        assert got == limit, "everything up to max_bytes, nothing past it"


def test_bad_read_and_write_arguments_are_typed_errors(home, runc_ready):
    with Sandbox.create(tier="container", timeout=300) as sb:
        sb.files.write("/workspace/f", "x")
        for mode in (-1, True, 0o10000, "644", 1.5, None):
            with pytest.raises(InvalidArgument, match="mode"):
                sb.files.write("/workspace/g", "x", mode=mode)
        assert not sb.files.exists("/workspace/g")
        assert oct(sb.files.write("/workspace/g", "x", mode=0o600).mode) == oct(0o600)
        for max_bytes in (0, -1, True, 1.5, "10"):  # None: the default (100 MiB whole, no cap streamed)
            with pytest.raises(InvalidArgument, match="max_bytes"):
                sb.files.read("/workspace/f", max_bytes=max_bytes)
        for timeout in (-1, float("nan"), "1"):
            with pytest.raises(InvalidArgument, match="timeout"):
                sb.files.read("/workspace/f", timeout=timeout)
        with pytest.raises(InvalidArgument, match="format"):
            sb.files.read("/workspace/f", format="lines")
        assert sb.files.read("/workspace/f", max_bytes=1, timeout=None) == "x"  # exactly max_bytes is fine
        sb.files.write("/workspace/two", "xy")
        with pytest.raises(FileTooLarge):
            sb.files.read("/workspace/two", max_bytes=1)


def _hostile_agent(path: str, chunks: int, stop: threading.Event) -> threading.Thread:
    """An agent that answers a ReadFile with ``chunks`` full chunks, ignoring window and acks."""

    def script(conn: socket.socket, req: p.Message | None) -> None:
        assert isinstance(req, p.ReadFile) and req.window > 0
        frame = p.encode(p.Chunk(req.id, data=bytes(p.CHUNK)))
        for _ in range(chunks):
            if stop.is_set():
                break
            conn.sendall(frame)
        conn.sendall(p.encode(p.ChunkEnd(req.id)))
        stop.wait(10)

    return scripted_agent(path, script)


@pytest.mark.parametrize("case", ["floods past the window", "sends past max_bytes"])
def test_a_hostile_agent_cannot_make_the_host_buffer(tmp_path, case):
    """The guest is untrusted: an agent that ignores the flow control or max_bytes is a
    protocol error on the host, and what the host holds stays bounded."""
    path = str(tmp_path / "agent.sock")
    stop = threading.Event()
    flood = case == "floods past the window"
    chunks = (512 * MiB) // p.CHUNK if flood else 3
    max_bytes = 1 << 40 if flood else 2 * p.CHUNK
    thread = _hostile_agent(path, chunks, stop)

    async def read() -> tuple[int, int]:
        client = await GuestClient.connect(path, "sb-hostile")
        got = 0
        try:
            reader = await client.read_file("/x", max_bytes=max_bytes)
            with PeakGrowth() as mem:
                await asyncio.sleep(1.5)  # a reader that takes nothing for a while
                with pytest.raises(GuestProtocolError):
                    while True:
                        msg = await reader.next(timeout=10)
                        assert isinstance(msg, p.Chunk), "the host took the whole flood"
                        got += len(msg.data)
            return got, mem.growth
        finally:
            stop.set()
            await client.close()

    got, growth = asyncio.run(read())
    thread.join(10)
    assert growth < SMALL, f"a hostile agent made the host hold {growth >> 20} MiB"
    assert got <= (READ_WINDOW + p.CHUNK if flood else max_bytes)
