"""The build's host-side parts without a sandbox: the build context, COPY layers, step commands,
the TOML form and the CLI's source resolution."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from warmbox.config import parse
from warmbox.engine.builder import copy_layer, has_python, wrapped_argv
from warmbox.errors import ConfigError, InvalidArgument, TemplateBuildError
from warmbox.models import LAYER_UID_BASE
from warmbox.templates import Copy, PipInstall, Run, Template
from warmbox.templates.context import pack_context, unpack_context
from warmbox.templates.toml import spec_from_table


def _ctx(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "dir" / "sub").mkdir(parents=True)
    (src / "dir" / "sub" / "a.txt").write_text("a")
    (src / "dir" / "run.sh").write_text("#!/bin/sh\n")
    (src / "dir" / "run.sh").chmod(0o755)
    (src / "dir" / "link").symlink_to("/etc/shadow")  # stored as a link, never followed
    (src / "one.conf").write_text("conf")
    return src


def test_context_round_trip_and_bounds(tmp_path: Path):
    src = _ctx(tmp_path)
    t = Template.from_template("base").copy("dir", "/app/").copy("one.conf", "/etc/one.conf").with_context(src)
    data = pack_context(t)
    assert data is not None
    out = tmp_path / "out"
    unpack_context(data, out)
    assert (out / "0" / "0" / "d" / "sub" / "a.txt").read_text() == "a"
    assert os.readlink(out / "0" / "0" / "d" / "link") == "/etc/shadow"
    assert (out / "1" / "0" / "f" / "one.conf").read_text() == "conf"
    assert pack_context(Template.from_template("base").run("true")) is None
    with pytest.raises(InvalidArgument, match=r"missing|No such"):
        pack_context(Template.from_template("base").copy("nope", "/x").with_context(src))
    with pytest.raises(InvalidArgument, match="outside the build context"):
        pack_context(Template.from_template("base").copy("../src/one.conf", "/x").with_context(src / "dir"))
    with pytest.raises(InvalidArgument, match="larger than"):
        pack_context(t, max_bytes=10)


def test_a_hostile_context_is_refused(tmp_path: Path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(InvalidArgument, match="not a safe tar"):
        unpack_context(buf.getvalue(), tmp_path / "ctx")
    assert not (tmp_path.parent / "escape").exists()


def _image(tmp_path: Path) -> list[str]:
    """Two fake layers (top first), owners shifted as the store keeps them."""
    low, top = tmp_path / "low", tmp_path / "top"
    (low / "home" / "user").mkdir(parents=True)
    os.chown(low / "home" / "user", LAYER_UID_BASE + 1000, LAYER_UID_BASE + 1000)
    (low / "home" / "user").chmod(0o750)
    (low / "usr" / "bin").mkdir(parents=True)
    (low / "usr" / "bin" / "python3").symlink_to("python3.11")
    (top / "usr").mkdir(parents=True)
    (low / "bin").symlink_to("usr/bin")
    return [str(top), str(low)]


def test_copy_layer_keeps_the_images_parents_and_sets_owners(tmp_path: Path):
    layers = _image(tmp_path)
    src = _ctx(tmp_path)
    t = (
        Template.from_template("base")
        .copy("dir", "/home/user/app/", chown="1000:1000")
        .copy("one.conf", "/etc/new/")
        .with_context(src)
    )
    ctx = tmp_path / "ctx"
    unpack_context(pack_context(t) or b"", ctx)
    out = tmp_path / "layer0"
    out.mkdir()
    copy_layer(out, ctx, t.steps[0], 0, layers)  # type: ignore[arg-type]
    home = (out / "home" / "user").lstat()
    assert (home.st_uid, stat.S_IMODE(home.st_mode)) == (1000, 0o750)  # as the image has it, unshifted
    app = out / "home" / "user" / "app"
    assert app.lstat().st_uid == 1000 and (app / "sub" / "a.txt").lstat().st_uid == 1000
    assert stat.S_IMODE((app / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(app / "link") == "/etc/shadow"
    out1 = tmp_path / "layer1"
    out1.mkdir()
    copy_layer(out1, ctx, t.steps[1], 1, layers)  # type: ignore[arg-type]
    new = (out1 / "etc" / "new").lstat()
    assert (new.st_uid, stat.S_IMODE(new.st_mode)) == (0, 0o755)
    assert (out1 / "etc" / "new" / "one.conf").read_text() == "conf"
    # through a symlink of the image (/bin -> usr/bin): refused, not a directory shadowing the link
    bad = Copy(("one.conf",), "/bin/tool")
    out2 = tmp_path / "layer2"
    out2.mkdir()
    (ctx / "5" / "0" / "f").mkdir(parents=True)
    (ctx / "5" / "0" / "f" / "one.conf").write_text("x")
    with pytest.raises(TemplateBuildError, match="not a directory in the image"):
        copy_layer(out2, ctx, bad, 5, layers)


def test_has_python_follows_the_merged_view(tmp_path: Path):
    layers = _image(tmp_path)
    assert has_python(layers)
    gone = tmp_path / "gone"
    (gone / "usr" / "bin").mkdir(parents=True)
    os.mknod(gone / "usr" / "bin" / "python3", stat.S_IFCHR | 0o600, 0)  # an overlay whiteout
    assert not has_python([str(gone), *layers])


def test_step_commands_run_in_the_workdir_as_the_user():
    argv = wrapped_argv(Run(shell="make"), "/app", "1000")
    assert argv[:3] == ["/bin/sh", "-c", 'mkdir -p "$1" && cd "$1" && shift && exec "$@"']
    assert argv[4] == "/app" and argv[5:9] == ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    assert argv[-3:] == ["/bin/bash", "-c", "make"]
    argv = wrapped_argv(Run(argv=("id",)), "", "root")
    assert argv[4] == "/" and argv[-2:] == ["sh", "id"]  # a RUN runs with the template's venv active
    assert "/opt/venv" in argv[-3] and 'exec "$@"' in argv[-3]
    assert "runuser" in wrapped_argv(Run(argv=("id",)), "/", "user:staff")
    pip = wrapped_argv(PipInstall(("six",), find_links="/w x"), "/", "")[-1]
    assert "--find-links '/w x'" in pip and "/opt/venv" in pip and ".pth" in pip


def test_toml_form(tmp_path: Path):
    t = spec_from_table(
        {
            "from": "base",
            "apt": ["cowsay"],
            "pip": ["six"],
            "pip_find_links": "/opt/wheels",
            "copy": [["app/", "/opt/app/"]],
            "run": ["make"],
            "env": {"A": "1"},
            "workdir": "/opt/app",
            "network": ["deb.debian.org"],
        },
        str(tmp_path),
    )
    assert t is not None
    assert t.describe() == [
        "FROM base",
        "APT cowsay",
        "PIP six",
        "COPY app/ /opt/app/",
        "RUN make",
        "ENV A=1",
        "WORKDIR /opt/app",
    ]
    assert t.context == str(tmp_path) and t.build_network.allow == ("deb.debian.org",)
    assert spec_from_table({"warmup_code": "x"}, str(tmp_path)) is None
    with pytest.raises(InvalidArgument, match="needs a source"):
        spec_from_table({"apt": ["x"]}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="one source"):
        spec_from_table({"from": "base", "debian": "bookworm"}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="takes no secrets"):  # never ignored
        spec_from_table({"from": "base", "run": ["true"], "secrets": {"TOKEN": "v"}}, str(tmp_path))
    with pytest.raises(InvalidArgument, match="takes no secrets"):
        spec_from_table({"dockerfile": "Dockerfile", "secrets": {"TOKEN": "v"}}, str(tmp_path))
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN true\n")
    assert spec_from_table({"dockerfile": "Dockerfile"}, str(tmp_path)).steps == (Run(shell="true"),)  # type: ignore[union-attr]


def test_warmbox_toml_templates_take_build_keys(tmp_path: Path):
    import tomllib

    raw = tomllib.loads('[templates.tools]\nfrom = "base"\napt = ["cowsay"]\nwarmup_code = "import os"\n')
    s = parse(raw, str(tmp_path / "warmbox.toml"))
    assert s.templates["tools"].build is not None and s.templates["tools"].warmup_code == "import os"
    assert s.templates["base"].build is None
    with pytest.raises(ConfigError, match=r"templates.bad: apt needs a source"):
        parse(tomllib.loads('[templates.bad]\napt = ["x"]\n'), "warmbox.toml")


def test_cli_resolves_files_and_names(tmp_path: Path):
    from warmbox.cli.templates import resolve

    d = tmp_path / "My Project"
    d.mkdir()
    (d / "Dockerfile").write_text("ARG V=1\nFROM base\nARG V\nRUN echo $V\n")
    name, t = resolve(str(d), None, None, {"V": "2"})
    assert name == "my-project" and t.steps == (Run(shell="export V=2; echo $V"),)
    (d / "tmpl.py").write_text("from warmbox import Template\ntemplate = Template.from_template('base').run('true')\n")
    assert resolve(str(d / "tmpl.py"), None, None, {})[0] == "tmpl"
    (d / "t.toml").write_text('[templates.one]\nfrom = "base"\nrun = ["true"]\n')
    assert resolve(str(d / "t.toml"), None, None, {})[0] == "one"
    name, t = resolve("browser", None, None, {})
    assert name == "browser" and t.build_network.mode == "allowlist"
    with pytest.raises(InvalidArgument):
        resolve("no-such-template-anywhere", None, None, {})
    with pytest.raises(InvalidArgument, match="built-in image"):
        resolve("base", None, None, {})
