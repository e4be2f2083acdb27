"""`warmbox shell` in a real terminal (a tmux pane): type, read the screen, resize the window."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/bootstrap)")


class Pane:
    """One tmux session on a private server socket, running one command."""

    def __init__(self, command: str, cols: int, rows: int) -> None:
        self.server = f"wbt-{secrets.token_hex(4)}"
        self.tmux("new-session", "-d", "-s", "t", "-x", str(cols), "-y", str(rows), command)
        self.tmux("set-option", "-t", "t", "remain-on-exit", "on")

    def tmux(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-L", self.server, *args], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", text)
        self.tmux("send-keys", "-t", "t", "Enter")

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if text in screen:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on the screen:\n{screen}")
            time.sleep(0.1)

    def dead(self) -> bool:
        return self.tmux("display-message", "-p", "-t", "t", "#{pane_dead}").strip() == "1"

    def close(self) -> None:
        socket_path = self.tmux("display-message", "-p", "#{socket_path}").strip()
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=10)
        if socket_path:
            Path(socket_path).unlink(missing_ok=True)  # tmux leaves its socket file behind


@pytest.mark.sandbox
def test_shell_in_a_terminal_types_reads_and_resizes(home, runc_ready):
    r = cli("create", "--timeout", "300")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    env = {k: v for k, v in os.environ.items() if k.startswith("WARMBOX_")}
    command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "warmbox.cli.main"])
    pane = Pane(f"{command} shell {sid}; echo shell-exited-$?; sleep 30", cols=100, rows=30)
    try:
        pane.wait_for("user@sandbox:/workspace$")  # the sandbox's bash prompt: typing goes there now
        pane.type("echo $((6 * 7)) $TERM")
        pane.wait_for("42 xterm-256color")
        pane.type("stty size; tty")
        screen = pane.wait_for("/dev/pts/")  # printed after the size
        assert "30 100" in screen
        pane.tmux("resize-window", "-t", "t", "-x", "120", "-y", "40")
        # SIGWINCH reaches the CLI, which resizes the sandbox's terminal: asked until it shows
        for _ in range(20):
            pane.type("clear; stty size")
            time.sleep(0.25)
            if "40 120" in pane.screen():
                break
        pane.wait_for("40 120", timeout=5)
        pane.type("sleep 100")  # Ctrl-C goes through raw mode to the sandbox's foreground job
        time.sleep(0.5)
        pane.tmux("send-keys", "-t", "t", "C-c")
        pane.type("echo after-interrupt")
        pane.wait_for("after-interrupt\n")
        pane.type("exit 7")
        pane.wait_for("shell-exited-7")
    finally:
        pane.close()
        cli("kill", sid)


@pytest.mark.sandbox
def test_shell_needs_a_terminal(home):
    r = cli("shell", "sb-000000000000", input="echo hi\n")
    assert r.returncode == 125 and "needs a terminal" in r.stderr


@pytest.mark.sandbox
def test_exec_it_is_a_terminal_as_docker_exec_it(home, runc_ready):
    """Issue 34: `warmbox exec -it ID bash` (docker's habit) was "unrecognized arguments"."""
    r = cli("create", "--timeout", "300")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    env = {k: v for k, v in os.environ.items() if k.startswith("WARMBOX_")}
    command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "warmbox.cli.main"])
    pane = Pane(f"{command} exec -it {sid} bash -l; echo exec-exited-$?; sleep 30", cols=100, rows=30)
    try:
        pane.wait_for("user@sandbox:/workspace$")
        pane.type("tty; exit 3")
        pane.wait_for("exec-exited-3")
        assert "/dev/pts/" in pane.screen()
    finally:
        pane.close()
        cli("kill", sid)
    r = cli("exec", "-it", "sb-000000000000", "bash", input="echo hi\n")
    assert r.returncode == 125 and "exec -t needs a terminal" in r.stderr
