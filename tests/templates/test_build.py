"""Real template builds (no internet): a local Debian repository and a local wheel directory made
here, copied into the image; build sandboxes on the container tier; sandboxes of the result."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import secrets
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from warmbox import Sandbox
from warmbox import operations as ops
from warmbox.engine.builder import log_dir
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import DockerfileError, TemplateBuildError, TemplateInUse, TemplateNotFound
from warmbox.models import TemplateBuildEvent
from warmbox.templates import Template
from warmbox.templates.context import pack_context

pytestmark = pytest.mark.sandbox
# the step cache is host-wide: a step of this run's own makes every key after it new (a first
# build really runs its steps, whatever earlier sessions cached)
TOKEN = secrets.token_hex(6)
DEB_CACHE = Path("/var/tmp/warmbox-test-debs")  # downloaded once per host (apt's configured mirror)
LOCAL_SOURCES = (
    "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && "
    "echo 'deb [trusted=yes] file:/opt/repo ./' > /etc/apt/sources.list.d/local.list"
)


def _wheel(out: Path, name: str, version: str = "1.0", body: str = "") -> Path:
    """A pure-Python wheel written by hand (no build backend, no index)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": (body or f"WHO = {name!r}\n").encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: warmbox-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return whl


@pytest.fixture(scope="session")
def repo(tmp_path_factory) -> Path:
    """A Debian repository with `hello` (downloaded once into DEB_CACHE, then served as file:)."""
    DEB_CACHE.mkdir(parents=True, exist_ok=True)
    if not list(DEB_CACHE.glob("hello_*.deb")):
        subprocess.run(["apt-get", "download", "hello"], cwd=DEB_CACHE, check=True, capture_output=True)
    out = tmp_path_factory.mktemp("ctx")
    repo = out / "repo"
    repo.mkdir()
    for deb in DEB_CACHE.glob("hello_*.deb"):
        shutil.copy(deb, repo)
    packages = subprocess.run(["dpkg-scanpackages", "."], cwd=repo, check=True, capture_output=True).stdout
    (repo / "Packages").write_bytes(packages)
    wheels = out / "wheels"
    wheels.mkdir()
    _wheel(wheels, "wbprobe")
    return out


@pytest.fixture(scope="module")
def engine(home: Path, runc_ready: None) -> Engine:
    return Engine.for_home(home)


async def _build(engine: Engine, name: str, t: Template) -> tuple[object, list[TemplateBuildEvent]]:
    events: list[TemplateBuildEvent] = []
    front = EngineFront(engine)
    try:
        info = await front.handle(ops.TemplateBuild(name, t, pack_context(t), events.append))
    finally:
        await front.close()
    return info, events


def _layer_events(events: list[TemplateBuildEvent]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in events:
        if e.step > 0 and e.status != "config":
            out.setdefault(e.step, set()).add(e.status)
    return out


def _spec(ctx: Path, greeting: str = "hello from the template") -> Template:
    return (
        Template.from_template("base")
        .run(f"echo {TOKEN} > /etc/build-token")
        .copy(str(ctx / "repo"), "/opt/repo/")
        .run(LOCAL_SOURCES)
        .apt_install(["hello"])
        .copy(str(ctx / "wheels"), "/opt/wheels/")
        .pip_install(["wbprobe"], find_links="/opt/wheels")
        .env({"GREETING": greeting})
        .workdir("/srv/app")
        .run("echo built > /srv/app/marker")
        .warmup(commands=["hello > /tmp/warmed"])
    )


def test_fluent_build_cache_and_sandbox(engine: Engine, repo: Path, tmp_path: Path):
    name = f"t-{os.getpid()}-fluent"
    t = _spec(repo)
    info, events = asyncio.run(_build(engine, name, t))
    try:
        assert info.version == 1 and len(info.layers) > 1
        assert "/" not in info.build_log  # a name: no host path reaches a caller
        log = log_dir(engine) / info.build_log
        assert log.is_file() and "hello" in log.read_text()
        layer_steps = _layer_events(events)
        assert all("running" in s and "done" in s for s in layer_steps.values()), layer_steps
        assert dict(info.env)["GREETING"] == "hello from the template"
        assert dict(info.env)["PATH"].startswith("/opt/venv/bin:")
        assert info.workdir == "/srv/app"

        # the same spec again: every layer from the cache, no build sandbox
        again, events2 = asyncio.run(_build(engine, name, t))
        assert again.image_id == info.image_id and again.version == info.version
        assert all(s == {"cached"} for s in _layer_events(events2).values()), _layer_events(events2)

        # a changed ENV (a config step before the last RUN): only what follows it runs again
        changed, events3 = asyncio.run(_build(engine, name, _spec(repo, greeting="changed")))
        steps3 = _layer_events(events3)
        last = max(steps3)
        assert steps3[last] == {"running", "done"}
        assert all(s == {"cached"} for n, s in steps3.items() if n != last), steps3
        assert changed.version == 2 and changed.image_id != info.image_id
        assert changed.layers[:-1] == info.layers[:-1]

        from warmbox import Sandbox

        wheels = tmp_path / "mine"
        wheels.mkdir()
        _wheel(wheels, "wbmine")
        with Sandbox.create(template=name, pool=False, timeout=300) as sb:
            r = sb.commands.run("hello && echo $GREETING && pwd && cat marker /tmp/warmed")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[:5] == ["Hello, world!", "changed", "/srv/app", "built", "Hello, world!"]
            # the template's pip packages: from the system python and from the sandbox's own venv
            r = sb.commands.run(
                "/usr/bin/python3 -c 'import wbprobe; print(wbprobe.WHO)' && python3 -c 'import wbprobe'"
            )
            assert r.exit_code == 0 and r.stdout.strip() == "wbprobe", r.stderr
            sb.files.write("/tmp/wbmine-1.0-py3-none-any.whl", (wheels / "wbmine-1.0-py3-none-any.whl").read_bytes())
            r = sb.commands.run("pip install --no-index /tmp/wbmine-1.0-py3-none-any.whl && python3 -c 'import wbmine'")
            assert r.exit_code == 0, r.stdout + r.stderr
            # in use: cannot be removed
            with pytest.raises(TemplateInUse):
                asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))
            with Sandbox.create(template=name, pool=False, timeout=300) as other:
                r = other.commands.run("python3 -c 'import wbmine'")
                assert r.exit_code != 0 and "wbmine" in r.stderr  # the first sandbox's install only
                r = other.commands.run("python3 -c 'import wbprobe'")
                assert r.exit_code == 0, r.stderr
    finally:
        with pytest.raises(TemplateNotFound):  # after removal: gone
            asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))
            asyncio.run(EngineFront(engine).handle(ops.TemplateGet(name)))


def test_dockerfile_build_env_workdir_user(engine: Engine, repo: Path):
    name = f"t-{os.getpid()}-docker"
    (repo / "Dockerfile").write_text(
        f"""\
FROM base
RUN echo {TOKEN} > /etc/build-token
ARG WHO=dockerfile
COPY repo/ /opt/repo/
RUN {LOCAL_SOURCES}
RUN apt-get update && \\
    apt-get install -y --no-install-recommends hello
ENV FROM_DOCKERFILE="yes $WHO"
WORKDIR /opt/site
RUN ["sh", "-c", "hello > /opt/site/greeting"]
USER 1000
RUN test "$(id -u)" = 1000 && test "$(pwd)" = /opt/site
EXPOSE 8080
"""
    )
    t = Template.from_dockerfile(repo / "Dockerfile")
    info, _events = asyncio.run(_build(engine, name, t))
    try:
        from warmbox.engine import images
        from warmbox.storage.templates import pin_name

        pin = pin_name(engine.registry, "", name, info.version)
        assert pin in images.store().pinned()  # the version's layers are pinned against any home's gc
        assert dict(info.env)["FROM_DOCKERFILE"] == "yes dockerfile"
        assert info.workdir == "/opt/site" and info.user == "1000"
        from warmbox import Sandbox

        with Sandbox.create(template=name, pool=False, timeout=300) as sb:
            r = sb.commands.run("echo $FROM_DOCKERFILE; pwd; cat greeting; hello")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[:4] == ["yes dockerfile", "/opt/site", "Hello, world!", "Hello, world!"]
    finally:
        asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))
    assert pin not in images.store().pinned()


def test_dockerfile_run_pip_install_installs_where_the_sandbox_python_looks(engine: Engine, repo: Path):
    # what a Docker user writes (issue 34, item 7): it was "error: externally-managed-environment"
    name = f"t-{os.getpid()}-runpip"
    wheels = repo / "wheels-runpip"
    wheels.mkdir(exist_ok=True)
    _wheel(wheels, "wbrunpip", body="WHO = 'run pip'\n")
    _wheel(wheels, "wbrunmod", body="WHO = 'run python3 -m pip'\n")
    (repo / "Dockerfile.runpip").write_text(
        f"""\
FROM base
RUN echo {TOKEN} > /etc/build-token
COPY wheels-runpip/ /opt/wheels-runpip/
RUN pip install --no-cache-dir --no-index --find-links /opt/wheels-runpip wbrunpip
RUN python3 -m pip install --no-index --find-links /opt/wheels-runpip wbrunmod && python3 -c 'import wbrunpip'
"""
    )
    t = Template.from_dockerfile(repo / "Dockerfile.runpip")
    try:
        asyncio.run(_build(engine, name, t))
        with Sandbox.create(template=name, pool=False, timeout=300) as sb:
            r = sb.commands.run("python3 -c 'import wbrunpip, wbrunmod; print(wbrunpip.WHO, wbrunmod.WHO, sep=\",\")'")
            assert r.exit_code == 0 and r.stdout == "run pip,run python3 -m pip\n", r
            r = sb.run_code("import wbrunpip; wbrunpip.WHO")
            assert r.text == "'run pip'", r
            # the sandbox's own pip still installs into its own venv, over the template's
            r = sb.commands.run("command -v pip")
            assert r.stdout == "/home/user/.venv/bin/pip\n", r
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))


def test_failing_run_names_the_step_and_keeps_its_log(engine: Engine):
    name = f"t-{os.getpid()}-fail"
    t = Template.from_template("base").run(f"echo {TOKEN}").run("echo about to fail; echo oops >&2; exit 3")
    with pytest.raises(TemplateBuildError) as e:
        asyncio.run(_build(engine, name, t))
    assert e.value.step.startswith("2: RUN echo about to fail")
    assert "exited 3" in str(e.value) and "oops" in str(e.value)
    assert "/" not in e.value.log and str(engine.home) not in str(e.value)
    log = log_dir(engine) / e.value.log
    assert log.is_file() and "about to fail" in log.read_text()
    with pytest.raises(TemplateNotFound):  # nothing recorded
        asyncio.run(EngineFront(engine).handle(ops.TemplateGet(name)))
    # (a pool's sandboxes may be warming meanwhile: the session's other tests grew the default pool)
    assert not [i for i in engine.list() if not i.pool], "a failed build left its sandbox"


def test_a_build_trusts_the_hosts_ca_bundle_and_keeps_it_out_of_the_layer(engine: Engine):
    name = f"t-{os.getpid()}-ca"
    # its two RUN steps change no file but the first one's /opt/venv (every RUN runs with it active)
    host = hashlib.sha256(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()).hexdigest()
    t = (
        Template.from_template("base")
        .run(f"echo {TOKEN}")
        .run(
            f'echo "{host}  $SSL_CERT_FILE" | sha256sum -c - && test "$PIP_CERT" = "$SSL_CERT_FILE" '
            '&& test "$NODE_EXTRA_CA_CERTS" = "$SSL_CERT_FILE" && python3 -c "import ssl; '
            "assert ssl.create_default_context().cert_store_stats()['x509_ca'] > 0\""
        )
    )
    try:
        asyncio.run(_build(engine, name, t))
        with Sandbox.create(template=name, pool=False, timeout=120) as sb:  # nothing of it in the image
            r = sb.commands.run("test ! -e /run/warmbox && echo absent; env")
            assert r.stdout.startswith("absent") and "SSL_CERT_FILE" not in r.stdout, r
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))


def test_an_image_without_python3_is_refused(engine: Engine):
    name = f"t-{os.getpid()}-nopy"
    t = Template.from_template("base").run("rm -f /usr/bin/python3")
    with pytest.raises(TemplateBuildError, match="python3"):
        asyncio.run(_build(engine, name, t))
    with pytest.raises(TemplateNotFound):
        asyncio.run(EngineFront(engine).handle(ops.TemplateGet(name)))


def test_unsupported_dockerfile_instruction_builds_nothing(tmp_path: Path):
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN true\nVOLUME /data\n")
    with pytest.raises(DockerfileError) as e:
        Template.from_dockerfile(tmp_path / "Dockerfile")
    assert e.value.line == 3 and "VOLUME" in str(e.value)


def test_cli_over_http_progress_ls_show_rm(engine: Engine, home: Path, tmp_path: Path):
    """The CLI through `warmbox serve` with a tenant's key: NDJSON progress lines, the template is
    the tenant's own (another tenant does not see it)."""
    from tests.conftest import cli, start_server

    name = f"t-{os.getpid()}-cli"
    (tmp_path / "Dockerfile").write_text("FROM base\nCOPY note.txt /opt/note.txt\nRUN cat /opt/note.txt\n")
    (tmp_path / "note.txt").write_text(f"copied over http {TOKEN}\n")
    server = start_server(home, home / "templates-cli.sock")
    try:
        _k, mine = engine.registry.tenants.create_key("tmpl-owner")
        _k, other = engine.registry.tenants.create_key("tmpl-other")
        env = {"WARMBOX_API_URL": server.url, "WARMBOX_API_KEY": mine}
        r = cli("template", "build", str(tmp_path), "--name", name, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "[1/2] COPY note.txt /opt/note.txt" in r.stderr and "DONE" in r.stderr  # plain lines: no TTY
        assert f"built {name} version 1" in r.stdout
        r = cli("template", "ls", env=env)
        assert r.returncode == 0 and name in r.stdout and "browser" in r.stdout, r.stderr
        r = cli("template", "show", name, "--json", env=env)
        assert r.returncode == 0, r.stderr
        import json

        shown = json.loads(r.stdout)
        assert shown["tenant"] == "tmpl-owner" and shown["version"] == 1
        assert "copied over http" in (log_dir(engine) / shown["build_log"]).read_text()
        r = cli("template", "show", name, env={**env, "WARMBOX_API_KEY": other})
        assert r.returncode == 125 and "no template" in r.stderr
        r = cli("template", "rm", name, env=env)
        assert r.returncode == 0 and "removed version(s) 1" in r.stdout, r.stderr
    finally:
        server.stop()


def test_dockerfile_from_an_oci_archive_and_a_registry(
    engine: Engine, home: Path, oci_archive: Path, oci_layout: Path, local_registry: str, tmp_path: Path
):
    """FROM an OCI archive made in the test (python3-minimal Debian, two layers, a whiteout), then
    ``FROM python:3.11-slim`` as a Docker user writes it: a Docker Hub name, pulled through
    ``[templates] registry_mirror`` from a docker-registry on 127.0.0.1 (never docker.io). The
    image's config is kept under the steps' changes, and a sandbox of each runs on it."""
    from warmbox import Sandbox
    from warmbox.errors import ImageRegistryUnreachable

    hub_copy = f"{local_registry}/library/python:3.11-slim"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{oci_layout}:py", f"docker://{hub_copy}"],
        check=True,
        capture_output=True,
    )
    (tmp_path / "Dockerfile").write_text(f"FROM oci-archive:{oci_archive}\nRUN echo built > /srv/built\nENV EXTRA=1\n")
    names = [f"t-{os.getpid()}-oci", f"t-{os.getpid()}-reg"]
    specs = [
        Template.from_dockerfile(tmp_path / "Dockerfile"),
        Template.from_dockerfile("FROM python:3.11-slim\nRUN echo built > /srv/built\nENV EXTRA=1\n"),
    ]
    toml = home / "warmbox.toml"
    before = toml.read_text()
    try:
        with pytest.raises(ImageRegistryUnreachable, match="registry_mirror"):
            toml.write_text(before + '\n[templates]\nregistry_mirror = "http://127.0.0.1:1"\n')
            asyncio.run(_build(engine, names[1], specs[1]))
        toml.write_text(before + f'\n[templates]\nregistry_mirror = "http://{local_registry}"\n')
        for name, spec in zip(names, specs, strict=True):
            info, _ = asyncio.run(_build(engine, name, spec))
            env = dict(info.env)
            assert env["WARMBOX_OCI"] == "1" and env["EXTRA"] == "1" and info.workdir == "/srv"
            with Sandbox.create(template=name, pool=False, timeout=120) as sb:
                r = sb.commands.run("cat /srv/hello.txt /srv/built; test ! -e /etc/motd; echo $WARMBOX_OCI$EXTRA")
                assert r.exit_code == 0, r.stderr
                assert r.stdout == "hello from the second layer\nbuilt\n11\n"
    finally:
        toml.write_text(before)
        for name in names:
            with contextlib.suppress(TemplateNotFound):
                asyncio.run(EngineFront(engine).handle(ops.TemplateDelete(name)))
