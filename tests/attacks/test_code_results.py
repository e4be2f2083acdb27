"""A cell that writes raw protocol frames to its own kernel's socket cannot make the host hold
unbounded results: the host stops at MAX_RESULTS per run with a typed error, and the sandbox
keeps working."""

from __future__ import annotations

import pytest

from warmbox import GuestProtocolError, Sandbox
from warmbox.engine.session import MAX_RESULTS

pytestmark = pytest.mark.sandbox

FLOOD = r"""
import os, socket, sys
p = sys.modules["warmbox.protocol"]  # the kernel's own copy: a user can speak the protocol
def is_socket(n):
    try:
        return os.readlink(f"/proc/self/fd/{n}").startswith("socket:")
    except OSError:  # the fd listdir itself used
        return False
fd = next(int(n) for n in os.listdir("/proc/self/fd") if is_socket(n))
s = socket.socket(fileno=os.dup(fd))
s.sendall(b"".join(
    p.encode(p.Display(id=0, mime="text/plain", data=b"", main=False, result=i)) for i in range(COUNT)
))
s.detach()
None
"""


def test_a_flood_of_empty_results_is_refused(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        with pytest.raises(GuestProtocolError, match="too much rich output"):
            sb.run_code(FLOOD.replace("COUNT", str(MAX_RESULTS * 4)))
        ctx = sb.create_code_context()
        assert sb.run_code("6 * 7", context=ctx).text == "42"
        assert sb.commands.run("echo ok").stdout == "ok\n"
