"""A sandbox's commands cannot make its transcript export unbounded.

Red-team finding: a command record keeps up to 4 KiB of the command's text, and an export read
up to 100,000 of them at once. A tenant makes that many 4 KiB cells in under a minute of
run_code; one export of it was a 440 MB body, 1.4 GB of server memory and ~5 s with the
server's event loop blocked (every other tenant's requests waited). The export now reads the
records a page at a time and stops at transcript.MAX_COMMAND_TEXT of text, marked truncated.
"""

from __future__ import annotations

import time

import pytest

from warmbox import Sandbox, transcript
from warmbox.engine.engine import Engine
from warmbox.models import CommandRecord

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

CELL = 4096  # a record's most text (text_truncated past it)


def test_many_large_commands_cannot_blow_up_an_export(home, runc_ready):
    filler = "#" + "x" * (CELL - 1)
    with Sandbox.create(tier="container", template="base", timeout=120) as sb:
        for i in range(3):  # what the sandbox really ran: recorded by the engine
            sb.run_code(f"{i}\n{filler}")
        sb.commands.history()  # the real records are written before the flood
        # the rest of the flood is written straight to the registry (as the batched writer would,
        # ~40 s of 4 KiB cells at full speed): what matters here is what an export then holds
        flood = (transcript.MAX_COMMAND_TEXT // CELL) + 500
        now = time.time()
        row = CommandRecord(
            sb.sandbox_id, 0, "code", filler, True, "python", now, 0.3, None, "", False, False, False, 0, 0
        )
        registry = Engine.for_home(home).registry
        for _ in range(0, flood, 2000):
            registry.commands.add_commands([row] * 2000)
        t = sb.export()
        body = transcript.dumps(t)
    assert t.truncated
    assert [c.seq for c in t.commands[:3]] == [1, 2, 3] and t.commands[0].text.startswith("0\n#x")
    text = sum(len(c.text) for c in t.commands)
    assert transcript.MAX_COMMAND_TEXT - CELL < text <= transcript.MAX_COMMAND_TEXT
    assert len(t.commands) < flood
    assert len(body) < transcript.MAX_COMMAND_TEXT * 1.2  # the file is about its text, not 100k records
    assert transcript.loads(body).truncated  # a reader of the file sees it was cut
