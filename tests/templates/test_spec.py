"""The Template spec, the Dockerfile subset and the step cache keys (no sandbox)."""

from __future__ import annotations

import os

import pytest

from warmbox import wire
from warmbox.errors import DockerfileError, InvalidArgument
from warmbox.network.policy import Network, Secret
from warmbox.templates import (
    AptInstall,
    BuildNetwork,
    BuiltSource,
    Copy,
    DebianSource,
    NpmInstall,
    OciSource,
    PipInstall,
    RegistrySource,
    Run,
    SetEnv,
    SetUser,
    SetWorkdir,
    Template,
    check_template,
    parse_dockerfile,
    spec_hash,
    step_key,
)
from warmbox.templates.keys import HOST_OWNER, owner, run_key, tree_hash, tree_hashes


def test_fluent_spec_is_immutable_and_ordered():
    base = Template.debian("bookworm", packages=["python3"])
    t = (
        base.apt_install(["hello"])
        .pip_install(["six"], find_links="/wheels")
        .npm_install(["left-pad"], **{"global": False})
        .run("make")
        .copy("src", "/app/")
        .env({"A": "1"})
        .workdir("/app")
        .user("1000")
        .warmup(code="import six", commands=["true"])
        .network(["deb.debian.org"])
    )
    assert base.steps == ()
    assert t.source == DebianSource("bookworm", ("python3",))
    assert t.steps == (
        AptInstall(("hello",)),
        PipInstall(("six",), find_links="/wheels"),
        NpmInstall(("left-pad",), global_=False),
        Run(shell="make"),
        Copy(("src",), "/app/"),
        SetEnv((("A", "1"),)),
        SetWorkdir("/app"),
        SetUser("1000"),
    )
    assert [type(s) for s in t.layer_steps()] == [AptInstall, PipInstall, NpmInstall, Run, Copy]
    assert t.warmup_code == "import six" and t.warmup_commands == ("true",)
    assert t.build_network.mode == "allowlist" and t.build_network.allow == ("deb.debian.org",)
    assert Template.from_template("base").source == BuiltSource("base")
    assert Template.from_registry("127.0.0.1:5000/img:1", tls_verify=False).source == RegistrySource(
        "127.0.0.1:5000/img:1", False
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Template.debian("Bookworm!"),
        lambda: Template.from_template("No Such/Name"),
        lambda: Template.from_registry("Ubuntu!"),
        lambda: Template.from_template("base").apt_install([]),
        lambda: Template.from_template("base").apt_install(["ok", "bad name; rm -rf /"]),
        lambda: Template.from_template("base").workdir("relative"),
        lambda: Template.from_template("base").copy("a", "/x/../etc"),
        lambda: Template.from_template("base").copy("a", "/x", chown="alice"),
        lambda: Template.from_template("base").env({"1BAD": "x"}),
        lambda: Template.from_template("base").run(""),
        lambda: Template.from_template("base").npm_install(["x"], globl=True),
        lambda: Template.from_template("base").network("sometimes"),
    ],
)
def test_bad_specs_are_invalid_argument(make):
    with pytest.raises(InvalidArgument):
        make()


def test_spec_round_trips_on_the_wire():
    t = Template.from_template("base").apt_install(["hello"]).run(["echo", "hi"]).env({"A": "b c"}).user("root")
    data = wire.encode(t)
    assert "context" not in data  # a client-side path: never sent
    back = wire.decode(Template, data, "template")
    assert back == t
    check_template(back)
    # a step of another kind with the same fields is told apart by its kind
    npm = Template.from_template("base").npm_install(["x"])
    assert wire.decode(Template, wire.encode(npm), "t").steps == (NpmInstall(("x",)),)


def test_dockerfile_subset():
    t = parse_dockerfile(
        """\
# syntax=docker/dockerfile:1
ARG SUITE=bookworm
FROM debian:${SUITE}
ARG SUITE
ARG VERSION=1.0
LABEL maintainer=me
RUN apt-get update && \\
    # a comment inside a continuation
    apt-get install -y hello
RUN ["python3", "-c", "print(1)"]
ENV A=1 B="two words" C=${VERSION}
ENV D some value
WORKDIR /app
WORKDIR sub
COPY --chown=1000:1000 a.txt b/ ./
COPY c.txt /etc/c.conf
ADD d.txt .
USER 1000
EXPOSE 8080
CMD ["python3"]
""",
        context="/ctx",
    )
    assert t.source == DebianSource("bookworm")
    assert t.context == "/ctx"
    assert t.steps == (
        Run(shell="export SUITE=bookworm; export VERSION=1.0; apt-get update &&     apt-get install -y hello"),
        Run(argv=("/usr/bin/env", "SUITE=bookworm", "VERSION=1.0", "python3", "-c", "print(1)")),
        SetEnv((("A", "1"), ("B", "two words"), ("C", "1.0"))),
        SetEnv((("D", "some value"),)),
        SetWorkdir("/app"),
        SetWorkdir("/app/sub"),
        Copy(("a.txt", "b/"), "/app/sub/", "1000:1000"),
        Copy(("c.txt",), "/etc/c.conf"),
        Copy(("d.txt",), "/app/sub"),
        SetUser("1000"),
    )
    assert any("LABEL" in n for n in t.notes) and any("CMD" in n for n in t.notes)


@pytest.mark.parametrize(
    ("image", "source"),
    [
        ("debian:12", DebianSource("bookworm")),
        ("debian:bookworm-slim", DebianSource("bookworm")),
        ("base", BuiltSource("base")),
        ("oci-archive:img.tar", OciSource("/ctx/img.tar")),
        ("127.0.0.1:5000/team/img:v1", RegistrySource("127.0.0.1:5000/team/img:v1")),
        ("localhost/img", RegistrySource("localhost/img")),
        # as Docker: a name without a registry host is Docker Hub's (official images: library/)
        ("python:3.11-slim", RegistrySource("docker.io/library/python:3.11-slim")),
        ("someone/tool:2", RegistrySource("docker.io/someone/tool:2")),
    ],
)
def test_dockerfile_from_forms(image, source):
    assert parse_dockerfile(f"FROM {image}\n", context="/ctx").source == source


@pytest.mark.parametrize(
    ("text", "line", "word"),
    [
        ("FROM base\nRUN true\nHEALTHCHECK CMD true\n", 3, "HEALTHCHECK"),
        ("FROM base AS a\nRUN true\nFROM base\n", 3, "FROM"),
        ("FROM base\n\nCOPY --from=a /x /y\n", 3, "--from"),
        ("FROM base\nADD https://example.com/x /x\n", 2, "URL"),
        ("FROM base\nADD x.tar.gz /x\n", 2, "archive"),
        ("FROM base\nONBUILD RUN true\n", 2, "ONBUILD"),
        ("FROM base\nVOLUME /data\n", 2, "VOLUME"),
        ('FROM base\nSHELL ["/bin/sh", "-c"]\n', 2, "SHELL"),
        ("FROM base\nRUN --mount=type=cache,target=/x true\n", 2, "--mount"),
        ("FROM base\nFROBNICATE x\n", 2, "FROBNICATE"),
        ("RUN true\n", 1, "before FROM"),
        ("# nothing\n", 0, "no FROM"),
        ("FROM scratch\n", 1, "scratch"),
        ("FROM base\nCOPY --chown=alice a /a\n", 2, "chown"),
        ("FROM base\nCOPY *.py /app/\n", 2, "wildcards"),
        ("FROM base\nENV 1X=2\n", 2, "variable name"),
    ],
)
def test_unsupported_dockerfile_lines_name_the_line(text, line, word):
    with pytest.raises(DockerfileError) as e:
        parse_dockerfile(text, source="Dockerfile")
    assert e.value.line == line
    assert word in str(e.value)
    assert isinstance(e.value, InvalidArgument)


def test_from_dockerfile_reads_a_file_with_its_directory_as_context(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM base\nCOPY x /x\n")
    t = Template.from_dockerfile(tmp_path / "Dockerfile")
    assert t.context == str(tmp_path)
    assert Template.from_dockerfile(str(tmp_path)).steps == t.steps  # a directory: its Dockerfile
    with pytest.raises(InvalidArgument):
        Template.from_dockerfile(tmp_path / "missing")


def test_step_keys_chain():
    a, b = Run(shell="make"), Run(shell="make install")
    k1 = step_key("root", a)
    assert k1 == step_key("root", a)
    assert step_key("root", b) != k1
    assert step_key("other", a) != k1  # everything after a changed step changes
    assert step_key("root", Copy(("x",), "/x"), "h1") != step_key("root", Copy(("x",), "/x"), "h2")
    t = Template.from_template("base").run("make")
    assert spec_hash(t) == spec_hash(Template.from_template("base").run("make"))
    assert spec_hash(t) != spec_hash(t.warmup(code="import x"))


def test_a_run_steps_key_holds_its_owner_and_the_build_network():
    step, none = Run(shell="make"), BuildNetwork()
    listed = BuildNetwork("allowlist", ("a.example", "b.example"))
    k = run_key("root", step, owner("t1"), listed)
    assert k == run_key("root", step, owner("t1"), BuildNetwork("allowlist", ("b.example", "a.example", "a.example")))
    assert k != run_key("root", step, owner("t2"), listed)  # another tenant
    assert k != run_key("root", step, owner(None), listed)  # the in-process SDK: an owner of its own
    assert owner(None) == HOST_OWNER != owner("host")  # no tenant name can be the host
    assert k != run_key("root", step, owner("t1"), none)  # another network
    assert k != run_key("root", step, owner("t1"), BuildNetwork("internet"))
    assert run_key("root", step, owner("t1"), none) != step_key("root", step)
    # what the builder runs for the step (its wrapper) is in the key: a builder that runs it
    # otherwise (a RUN's pip going to the image's venv) never takes an older builder's layer
    assert run_key("root", step, owner("t1"), listed, ["sh", "-c", "a"]) != run_key(
        "root", step, owner("t1"), listed, ["sh", "-c", "b"]
    )


@pytest.mark.parametrize(
    "policy, secrets, match",
    [
        (["a.example"], {"TOKEN": Secret("v", hosts=["a.example"])}, "takes no secrets"),
        ("internet", {"TOKEN": "v"}, "takes no secrets"),
        ({"allow": ["a.example"], "secrets": {"TOKEN": "v"}}, None, "takes no secrets"),
        (Network(allow=["a.example"], on_unknown="ask"), None, "cannot ask"),
        (Network(allow=["a.example"], deny=["b.example"]), None, "allow list only"),
    ],
)
def test_a_build_network_is_never_narrowed_quietly(policy, secrets, match):
    with pytest.raises(InvalidArgument, match=match):
        Template.from_template("base").network(policy, secrets=secrets)
    t = Template.from_template("base").network(Network(allow=["a.example"]), secrets={})
    assert t.build_network == BuildNetwork("allowlist", ("a.example",))


def test_tree_hash_sees_content_modes_and_links_never_follows(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("one")
    h1 = tree_hash(str(tmp_path / "d"))
    (tmp_path / "d" / "f").write_text("two")
    h2 = tree_hash(str(tmp_path / "d"))
    assert h1 != h2
    (tmp_path / "d" / "f").chmod(0o755)
    assert tree_hash(str(tmp_path / "d")) != h2
    (tmp_path / "outside").write_text("secret")
    (tmp_path / "d" / "l").symlink_to(tmp_path / "outside")
    h3 = tree_hash(str(tmp_path / "d"))
    (tmp_path / "outside").write_text("changed")
    assert tree_hash(str(tmp_path / "d")) == h3  # the link's target, not what it points to


def test_tree_hashes_second_sees_the_mtimes_a_layer_keeps(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    os.symlink("f", tmp_path / "d" / "l")
    plain, timed = tree_hashes(str(tmp_path / "d"))
    assert plain == tree_hash(str(tmp_path / "d")) and timed != plain
    os.utime(tmp_path / "d" / "f", (1_000_000_000, 1_000_000_000))
    p2, t2 = tree_hashes(str(tmp_path / "d"))
    assert p2 == plain and t2 != timed
    os.utime(tmp_path / "d" / "l", (1_000_000_000, 1_000_000_000), follow_symlinks=False)
    p3, t3 = tree_hashes(str(tmp_path / "d"))
    assert p3 == plain and t3 != t2
    os.utime(tmp_path / "d", (5, 5))  # a layer keeps no directory mtime
    assert tree_hashes(str(tmp_path / "d")) == (p3, t3)


def test_docker_hub_images_go_through_the_registry_mirror(tmp_path):
    """[templates] registry_mirror: Docker Hub's images come from it (its path prefix kept, plain
    HTTP for http://); other registries' do not; a malformed mirror is a ConfigError."""
    from warmbox import config
    from warmbox.errors import ConfigError
    from warmbox.templates.spec import through_mirror

    hub = Template.from_registry("python:3.11-slim").source.ref
    assert hub == "docker.io/library/python:3.11-slim"
    assert through_mirror(hub, True, "") == (hub, True)
    assert through_mirror(hub, True, "http://127.0.0.1:5000") == ("127.0.0.1:5000/library/python:3.11-slim", False)
    assert through_mirror(hub, True, "https://mirror.example/hub/") == (
        "mirror.example/hub/library/python:3.11-slim",
        True,
    )
    assert through_mirror("quay.io/a/b:1", True, "mirror.example") == ("quay.io/a/b:1", True)
    s = config.parse({"templates": {"registry_mirror": "http://127.0.0.1:5000", "t": {"from": "base"}}})
    assert s.registry_mirror == "http://127.0.0.1:5000" and "t" in s.templates
    for bad in ("ftp://m.example", "m.example/../x", "m example", 5):
        with pytest.raises(ConfigError, match="registry_mirror"):
            config.parse({"templates": {"registry_mirror": bad}})
