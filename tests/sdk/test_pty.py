"""Terminals in real sandboxes: sandbox.pty.create, typing, resizing, connect from another client, kill."""

from __future__ import annotations

import time

import pytest

from warmbox import Sandbox


def _until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.sandbox
@pytest.mark.parametrize("tier", ["container", "gvisor", "microvm"])
def test_pty_types_resizes_and_is_shared(home, runc_ready, tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        screen = bytearray()
        term = sb.pty.create(cols=100, rows=30, on_data=screen.extend)
        _until(lambda: b"$ " in screen)  # bash's prompt
        term.send_input("stty size; tty; echo $TERM\n")
        _until(lambda: b"30 100" in screen and b"xterm-256color" in screen)
        assert b"/dev/pts/" in screen
        term.resize(120, 40)
        term.send_input("stty size\n")
        _until(lambda: b"40 120" in screen)
        assert any(p.pid == term.pid and p.pty for p in sb.commands.list())
        other = Sandbox.connect(sb.sandbox_id)  # another client sees the same terminal
        try:
            seen = bytearray()
            again = other.pty.connect(term.pid, on_data=seen.extend)
            _until(lambda: b"40 120" in seen)  # what the sandbox kept, then live
            other.pty.send_stdin(term.pid, "echo from-$((1+1))-clients\n")
            _until(lambda: b"from-2-clients" in screen and b"from-2-clients" in seen)
            term.send_input("exit 5\n")
            assert again.wait().exit_code == 5
        finally:
            other.close()
        assert term.wait().exit_code == 5
        term2 = sb.pty.create(cmd=["sleep", "600"])
        assert term2.kill() is True and term2.wait().signal == 9
