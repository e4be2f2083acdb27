"""The provisioning pipeline: a cold start and a memory restore go through the same checks."""

from __future__ import annotations

import asyncio

import pytest

from warmbox.engine import provision
from warmbox.engine.start import StartRecord
from warmbox.errors import InvalidArgument
from warmbox.models import Limits

pytestmark = pytest.mark.sandbox  # probes the gVisor tier (runsc present, root)


def test_cold_and_restore_refuse_a_socket_path_that_does_not_fit_alike(tmp_path, monkeypatch, runc_ready):
    from warmbox.engine.engine import Engine

    long_dir = tmp_path / ("r" * 120)
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(long_dir))
    engine = Engine(tmp_path / "home")
    tmpl = engine.settings().template("shell")
    spec = provision.LaunchSpec(StartRecord.internal("gvisor", tmpl.name, 60.0, Limits()))
    boots = [provision.Cold(tmpl), provision.Restore("snap-0", tmp_path / "mem", tmp_path / "ws.tar")]
    errors = []
    for boot in boots:
        with pytest.raises(InvalidArgument) as e:
            asyncio.run(provision.launch(engine, spec, boot))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "too long for a unix socket path" in errors[0]
    assert engine.list(include_dead=True) == []  # refused before any row, directory or runtime
    assert not (long_dir / "sandboxes").exists()
