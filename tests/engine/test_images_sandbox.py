"""Sandboxes run images: the built-in one (not the host's /usr), a template's versions, recorded images.

A template ``app`` is recorded in the registry as the built-in image's layers plus one small layer
holding /etc/wb-marker (its version's name), as a build would leave it; the built-in image comes
from the host's image cache (scripts/bootstrap install builds it).
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest

from tests.conftest import set_config, wait_for
from warmbox import Limits, Sandbox, State
from warmbox.engine import images, resolve, teardown
from warmbox.engine.engine import Engine
from warmbox.errors import TemplateMismatch
from warmbox.models import TemplateInfo
from warmbox.storage.layers import LayerStore, image_id_of

pytestmark = pytest.mark.sandbox
NUMPY = "python3 -c 'import numpy; print(numpy.__version__)'"
AGENT_TURN = r"""set -e
mkdir -p /workspace/pkg/src/wbdemo /workspace/pkg/tests && cd /workspace/pkg
printf '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' > pyproject.toml
printf '[project]\nname = "wbdemo"\nversion = "0.1"\n' >> pyproject.toml
echo 'def add(a, b): return a + b' > src/wbdemo/__init__.py
printf 'from wbdemo import add\n\ndef test_add():\n    assert add(2, 2) == 4\n' > tests/test_add.py
python3 -m build --no-isolation --wheel --outdir dist . > build.log 2>&1 || { cat build.log; exit 1; }
ls dist/*.whl
PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider tests | tail -1 | cut -d' ' -f1,2
git init -q && git add pyproject.toml src tests && git -c user.email=a@b.test -c user.name=a commit -qm init
git log --oneline | wc -l
printf 'all:\n\t@echo made\n' > Makefile && make
printf 'int main(void) { return 0; }\n' > t.c && gcc t.c -o t && ./t
echo '{"a": [1, 2]}' | jq -c .a
rg -l 'def add' src
npx --version > /dev/null && curl --version > /dev/null && unzip -v > /dev/null && patch --version > /dev/null
echo tools ok
"""


@pytest.fixture(scope="module")
def app(home: Path, runc_ready: None, tmp_path_factory: pytest.TempPathFactory):
    """add(label) records the next version of template ``app``: the built-in layers + a marker."""
    engine = Engine.for_home(home)
    base = resolve.image_for(engine, "base")
    rec = images.builtin_record()
    assert rec is not None and rec.image_id == base.image_id
    store = images.store()
    made: list[str] = []
    tag = secrets.token_hex(4)  # this session's own layers: removed at the end, never another's

    def add(label: str, name: str = "app") -> TemplateInfo:
        src = tmp_path_factory.mktemp("layer")
        (src / "etc").mkdir()
        (src / "etc" / "wb-marker").write_text(f"{label} {tag}\n")
        d = store.add_tree(src, owner_base=0).digest
        made.append(d)
        digests = (*rec.layers, d)
        return engine.registry.templates.template_add(
            TemplateInfo(
                name=name,
                version=0,
                image_id=image_id_of(digests, (), "", ""),
                layers=digests,
                warmup_code=None,
                created_at=time.time(),
            )
        )

    yield add
    for d in made:
        LayerStore(images.cache()).remove(d)


def _marker(box) -> str:
    return box.commands.run("cat /etc/wb-marker").stdout.split()[0]


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_a_sandbox_runs_the_builtin_image_and_shows_it(home, runc_ready, tier):
    engine = Engine.for_home(home)
    base = resolve.image_for(engine, "base")
    with Sandbox.create(tier=tier, template="shell", pool=False) as box:
        info = box.get_info()
        assert (info.template, info.template_version, info.image_id) == ("shell", 0, base.image_id)
        # the image's /usr, not the host's: runc is on the host only, pytest and scipy in the image
        r = box.commands.run("test -e /usr/sbin/runc || test -e /usr/bin/runc; echo $?; python3 -m pytest --version")
        assert r.stdout.splitlines()[0] == "1", r
        assert "pytest 7" in r.stdout + r.stderr
        for cmd in ("python3 -c 'import scipy, pandas, matplotlib, requests'", "node -e 1", "npm --version", "make -v"):
            assert box.commands.run(cmd).exit_code == 0, cmd
        assert engine.registry.sandboxes.get(box.sandbox_id)[0].image_id == base.image_id
        if tier != "container":
            return  # one tree on every tier: its tools are checked once
        # a coding agent's turn, offline (issue 34, item 10): build a wheel, test, commit, make, cc, jq, rg
        r = box.commands.run(["/bin/bash", "-c", AGENT_TURN], timeout=240)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert r.stdout.split("\n")[:7] == [
            "dist/wbdemo-0.1-py3-none-any.whl",
            "1 passed",
            "1",
            "made",
            "[1,2]",
            "src/wbdemo/__init__.py",
            "tools ok",
        ], r.stdout


def test_numpy_is_the_image_s_on_container_and_gvisor(home, runc_ready):
    """The same template gives the same numpy on every tier (the microVM's in test_microvm_image)."""
    layer = Path(resolve.image_for(Engine.for_home(home), "base").layers[0])
    found = sorted(p.name for p in (layer / "usr/lib/python3/dist-packages").glob("numpy-*.egg-info"))
    assert found, "no numpy in the built-in image"
    want = found[0].split("-")[1].removesuffix(".egg")
    got = {}
    for tier in ("container", "gvisor"):
        with Sandbox.create(tier=tier, template="shell", pool=False) as box:
            got[tier] = box.commands.run(NUMPY).stdout.strip()
    assert got == {"container": want, "gvisor": want}


@pytest.mark.microvm
def test_numpy_is_the_image_s_on_microvm_too(home, runc_ready):
    """The microVM's root is made from the same Debian tree (run under flock /work/vm.lock)."""
    layer = Path(resolve.image_for(Engine.for_home(home), "base").layers[0])
    want = sorted(p.name for p in (layer / "usr/lib/python3/dist-packages").glob("numpy-*.egg-info"))
    with Sandbox.create(tier="microvm", template="shell", timeout=300, limits=Limits(memory_mb=512)) as box:
        got = box.commands.run(NUMPY, timeout=120).stdout.strip()
        assert box.get_info().image_id == resolve.image_for(Engine.for_home(home), "shell").image_id
    assert want and got == want[0].split("-")[1].removesuffix(".egg")


def test_snapshot_of_v1_restores_on_v1_after_a_rebuild_and_a_gone_image_is_refused(home, app):
    engine = Engine.for_home(home)
    v1 = app("v1")
    with Sandbox.create(tier="container", template="app", pool=False) as box:
        assert _marker(box) == "v1"
        info = box.get_info()
        assert (info.template_version, info.image_id) == (v1.version, v1.image_id)
        box.commands.run("echo kept > /workspace/f")
        ref = box.snapshot()
    v2 = app("v2")
    with Sandbox.create(tier="container", template="app", pool=False) as box:
        assert _marker(box) == "v2" and box.get_info().template_version == v2.version
    with Sandbox.create(from_snapshot=ref) as box:  # the recorded image, not the latest
        assert _marker(box) == "v1"
        assert box.commands.run("cat /workspace/f").stdout == "kept\n"
        info = box.get_info()
        assert (info.template_version, info.image_id) == (v1.version, v1.image_id)
    assert resolve.template_users(engine, "app", v1.version)[-1] == ref.snapshot_id
    # v1 removed: its snapshot cannot come back on another image; no sandbox is left half-made
    engine.registry.templates.template_delete("app", v1.version)
    before = {i.sandbox_id for i in engine.list(include_dead=True)}
    with pytest.raises(TemplateMismatch, match=f"version {v1.version}"):
        Sandbox.create(from_snapshot=ref)
    assert {i.sandbox_id for i in engine.list(include_dead=True)} == before


def test_a_memory_snapshot_resumes_on_its_own_image(home, app):
    v1 = app("m1", name="appm")
    box = Sandbox.create(tier="gvisor", template="appm", pool=False)
    try:
        box.commands.run("sleep 1000", background=True)
        box.pause(memory=True)
        app("m2", name="appm")  # rebuilt while paused
        box = Sandbox.resume(box.sandbox_id)
        assert _marker(box) == "m1"
        assert box.get_info().image_id == v1.image_id
        assert box.commands.run("pgrep -x sleep").exit_code == 0  # its processes continued
    finally:
        box.kill()


POOL = """
[templates.apppool]
warmup_code = ""

[pools.apppool]
template = "apppool"
min = 1
max = 1
target = 1
limits = { memory_mb = 300 }
"""


def test_a_rebuilt_template_retires_its_pool_and_refills_it(home, app):
    engine = Engine.for_home(home)
    v1 = app("p1", name="apppool")
    set_config(home, POOL)
    try:
        engine.ensure_daemon()

        def pooled(image_id: str) -> list[str]:
            return [
                i.sandbox_id
                for i in engine.list(include_pooled=True)
                if i.pool == "apppool" and i.state is State.POOLED and i.image_id == image_id
            ]

        old = wait_for(lambda: pooled(v1.image_id), 120, "a pooled sandbox of v1")
        assert resolve.template_users(engine, "apppool") == [*old, "apppool"]
        v2 = app("p2", name="apppool")
        new = wait_for(lambda: pooled(v2.image_id), 120, "the pool to refill with v2")
        wait_for(
            lambda: engine.registry.sandboxes.get(old[0])[0].state is State.DESTROYED, 60, "v1's sandbox to retire"
        )
        with Sandbox.create(tier="container", template="apppool", limits=Limits(memory_mb=300)) as box:
            assert box.from_pool and box.sandbox_id == new[0]
            assert _marker(box) == "p2" and box.get_info().template_version == v2.version
    finally:
        set_config(home)
        wait_for(lambda: not engine.registry.pools.pooled("apppool"), 60, "the pool to be retired")


def test_builtin_image_is_reported_by_doctor(home, runc_ready):
    rows = {r.tier: r for r in Engine.for_home(home).doctor()}
    assert "built-in image builtin-" in rows["container"].reason and " built (" in rows["container"].reason


def test_a_launch_without_an_image_runs_its_template_s(home, runc_ready):
    """provision.launch itself resolves a missing image: no engine path starts a host-/usr sandbox."""
    import asyncio

    from warmbox.engine import provision
    from warmbox.engine.start import StartRecord

    engine = Engine.for_home(home)
    tmpl = resolve.template(engine, "shell")

    async def go() -> tuple[str, str]:
        spec = provision.LaunchSpec(StartRecord.internal("container", "shell", 60.0, Limits()))
        got = await provision.launch(engine, spec, provision.Cold(tmpl))
        try:
            r = await got.session.exec(["/bin/sh", "-c", "test -e /usr/sbin/runc || test -e /usr/bin/runc; echo $?"])
            return got.info.image_id, r.stdout.strip()
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")

    image_id, host_runc = asyncio.run(go())
    assert image_id == resolve.image_for(engine, "shell").image_id and host_runc == "1"
