"""A Dockerfile subset as a :class:`~warmbox.templates.spec.Template`.

Supported: ``FROM`` (one stage: ``debian:<suite>`` → a Debian image, ``oci-archive:PATH``, a
registry image ``host[:port]/name[:tag]`` or, as in Docker, a Docker Hub one (``python:3.11-slim``
is ``docker.io/library/python:3.11-slim``; ``[templates] registry_mirror`` pulls it from a mirror),
or the name of a template built on this host (a name without tag or '/', such as ``base``)),
``RUN`` (shell and JSON exec forms), ``COPY``/``ADD`` of local files (``--chown=uid[:gid]``),
``ENV`` (both forms), ``WORKDIR``, ``USER``, ``ARG`` (with defaults; ``build_args`` override),
line continuations and ``$VAR``/``${VAR}``/``${VAR:-default}``/``${VAR:+alt}`` substitution where
Docker substitutes. ``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``STOPSIGNAL`` and
``MAINTAINER`` are recorded in ``Template.notes`` and otherwise ignored (a sandbox runs no
entrypoint). Anything else — a second ``FROM`` (multi-stage), ``COPY --from``, ``ADD`` of a URL
or an archive, ``ONBUILD``, ``HEALTHCHECK``, ``VOLUME``, ``SHELL``, ``RUN --mount`` — raises
:class:`~warmbox.errors.DockerfileError` with the instruction's line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping

from warmbox.errors import DockerfileError, InvalidArgument
from warmbox.templates import spec

MAX_DOCKERFILE = 1 << 20
DEBIAN_VERSIONS = {"10": "buster", "11": "bullseye", "12": "bookworm", "13": "trixie"}
IGNORED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "STOPSIGNAL", "MAINTAINER"}
UNSUPPORTED = {
    "ONBUILD": "ONBUILD triggers are not supported",
    "HEALTHCHECK": "HEALTHCHECK is not supported (a sandbox runs no service to check)",
    "VOLUME": "VOLUME is not supported: use warmbox volumes (Sandbox.create(volumes=[...]))",
    "SHELL": "SHELL is not supported: RUN uses /bin/bash -c",
}
_VAR = re.compile(r"\\\$|\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_ARCHIVE = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


def read_dockerfile(path_or_text: str | os.PathLike[str]) -> tuple[str, str, str]:
    """(text, name shown in errors, its directory: the default build context)."""
    if isinstance(path_or_text, str) and "\n" in path_or_text:
        return path_or_text, "<Dockerfile text>", os.getcwd()
    path = os.fspath(path_or_text)
    if os.path.isdir(path):
        path = os.path.join(path, "Dockerfile")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DOCKERFILE + 1)
    except OSError as e:
        raise InvalidArgument(f"cannot read Dockerfile {path}: {e.strerror}") from None
    if len(raw) > MAX_DOCKERFILE:
        raise DockerfileError(f"{path}: larger than {MAX_DOCKERFILE} bytes", source=path)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise DockerfileError(f"{path}: not UTF-8 text", source=path) from None
    return text, path, os.path.dirname(os.path.abspath(path))


def _instructions(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, INSTRUCTION, rest) with continuations joined and comments dropped."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i + 1
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = []
        while True:
            stripped = line.rstrip()
            if stripped.endswith("\\"):
                parts.append(stripped[:-1])
                # comment and empty lines inside a continuation are skipped (as Docker does)
                while i < len(lines) and (lines[i].lstrip().startswith("#") or not lines[i].strip()):
                    i += 1
                if i >= len(lines):
                    break
                line = lines[i]
                i += 1
                continue
            parts.append(line)
            break
        joined = "".join(parts).strip()
        word, _, rest = joined.partition(" ")
        if "\t" in word:
            word, _, more = word.partition("\t")
            rest = more + " " + rest
        yield start, word.upper(), rest.strip()


class _Parser:
    def __init__(self, source: str, context: str, build_args: Mapping[str, str]) -> None:
        self.source = source
        self.context = context
        self.build_args = dict(build_args)
        self.args: dict[str, str] = {}  # ARGs in scope (for substitution and RUN's environment)
        self.global_args: dict[str, str] = {}  # those declared before FROM
        self.env: dict[str, str] = {}
        self.template: spec.Template | None = None
        self.notes: list[str] = []
        self.line = 0

    def fail(self, message: str) -> DockerfileError:
        return DockerfileError(f"{self.source}:{self.line}: {message}", line=self.line, source=self.source)

    def expand(self, value: str) -> str:
        scope = {**self.args, **self.env}

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "\\$":
                return "$"
            name = m.group(1) or m.group(4)
            val = scope.get(name, "")
            if m.group(2) == "-":
                return val or m.group(3)
            if m.group(2) == "+":
                return m.group(3) if val else ""
            return val

        return _VAR.sub(sub, value)

    def words(self, rest: str) -> list[str]:
        try:
            return shlex.split(rest)
        except ValueError as e:
            raise self.fail(f"cannot parse {rest[:80]!r}: {e}") from None

    def json_form(self, rest: str) -> list[str] | None:
        if not rest.startswith("["):
            return None
        try:
            value = json.loads(rest)
        except ValueError:
            return None  # Docker: not valid JSON means the shell form
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail("the exec form must be a JSON list of strings")
        return value

    def flags(self, rest: str, allowed: set[str]) -> tuple[dict[str, str], str]:
        out: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            if name not in allowed:
                raise self.fail(f"flag --{name} is not supported")
            out[name] = value
            rest = rest.lstrip()
        return out, rest

    def add(self, step: spec.Step) -> None:
        if self.template is None:
            raise self.fail("an instruction before FROM")
        try:
            self.template = self.template._add(step)
        except InvalidArgument as e:
            raise self.fail(str(e)) from None

    # -- instructions

    def FROM(self, rest: str) -> None:
        if self.template is not None:
            raise self.fail("a second FROM (multi-stage builds are not supported)")
        _, rest = self.flags(rest, set())
        words = self.words(rest)
        if len(words) == 3 and words[1].lower() == "as":
            words = words[:1]
        if len(words) != 1:
            raise self.fail("FROM takes one image (and an optional AS name)")
        image = self.expand(words[0])
        # ARGs before FROM are FROM's only; one declared again after it (no value) takes their default
        self.global_args, self.args = self.args, {}
        try:
            self.template = self.source_of(image)
        except InvalidArgument as e:
            raise self.fail(str(e)) from None

    def source_of(self, image: str) -> spec.Template:
        if image.startswith(("oci-archive:", "oci:")):
            path = image.partition(":")[2].split(":")[0] if image.startswith("oci:") else image[len("oci-archive:") :]
            if not path:
                raise InvalidArgument("oci-archive: needs a path")
            return spec.Template.from_oci(os.path.join(self.context, path))
        if image.startswith("debian:") or image == "debian":
            tag = image.partition(":")[2] or "bookworm"
            suite = tag.removesuffix("-slim")
            suite = DEBIAN_VERSIONS.get(suite.split(".")[0], suite)
            if suite != tag:
                self.notes.append(f"line {self.line}: FROM {image} built as Debian {suite} with mmdebstrap")
            return spec.Template.debian(suite)
        if image == "scratch":
            raise InvalidArgument("FROM scratch is not supported (a sandbox needs python3): use debian:<suite>")
        if "/" in image or ":" in image or "@" in image:
            # a registry image; one without a registry host is Docker Hub's, as in Docker
            return spec.Template.from_registry(image)
        return spec.Template.from_template(image)

    def RUN(self, rest: str) -> None:
        if rest.startswith("--"):
            raise self.fail(f"RUN {rest.split()[0]} is not supported")
        argv = self.json_form(rest)
        if not rest:
            raise self.fail("RUN needs a command")
        # ARGs are in RUN's environment (as in Docker); the shell expands them
        args = {k: v for k, v in self.args.items() if k not in self.env}
        if argv is not None:
            if not argv:
                raise self.fail("RUN needs a command")
            if args:
                argv = ["/usr/bin/env", *(f"{k}={v}" for k, v in args.items()), *argv]
            self.add(spec.Run(argv=tuple(argv)))
        else:
            prefix = "".join(f"export {k}={shlex.quote(v)}; " for k, v in args.items())
            self.add(spec.Run(shell=prefix + rest))

    def COPY(self, rest: str, add: bool = False) -> None:
        flags, rest = self.flags(rest, {"chown", "from", "chmod", "link"})
        if "from" in flags:
            raise self.fail("COPY --from (multi-stage builds) is not supported")
        if "chmod" in flags:
            raise self.fail("COPY --chmod is not supported (use RUN chmod)")
        if "link" in flags:
            self.notes.append(f"line {self.line}: --link ignored (every step is its own layer)")
        words = self.json_form(rest)
        if words is None:
            words = self.words(rest)
        words = [self.expand(w) for w in words]
        if len(words) < 2:
            raise self.fail("COPY needs a source and a destination")
        *sources, dest = words
        for s in sources:
            if add and re.match(r"^[a-z]+://", s):
                raise self.fail(f"ADD of a URL ({s}) is not supported: no network at parse time; RUN curl it")
            if add and s.endswith(_ARCHIVE):
                raise self.fail(f"ADD of an archive ({s}) is not supported: COPY it and RUN tar")
            if any(c in s for c in "*?["):
                raise self.fail(f"wildcards in COPY sources ({s}) are not supported")
        workdir = self.workdir()
        if not dest.startswith("/"):
            dest = workdir.rstrip("/") + "/" + dest
        trailing = dest.endswith("/") or len(sources) > 1
        dest = os.path.normpath(dest).replace("//", "/") + ("/" if trailing and dest != "/" else "")
        chown = flags.get("chown", "")
        try:
            chown = spec.check_chown(self.expand(chown))
        except InvalidArgument as e:
            raise self.fail(f"--chown: {e} (user names are not resolved)") from None
        self.add(spec.Copy(tuple(sources), dest, chown))

    def ADD(self, rest: str) -> None:
        self.COPY(rest, add=True)

    def workdir(self) -> str:
        assert self.template is not None
        for s in reversed(self.template.steps):
            if isinstance(s, spec.SetWorkdir):
                return s.path
        return "/"

    def ENV(self, rest: str) -> None:
        words = self.words(rest)
        if not words:
            raise self.fail("ENV needs NAME=value")
        pairs: dict[str, str] = {}
        if "=" not in words[0]:  # ENV NAME value with spaces
            name, _, value = rest.partition(" ")
            value = value.strip()
            parsed = self.words(value) if value else [""]
            pairs[name] = self.expand(" ".join(parsed))
        else:
            for w in words:
                name, eq, value = w.partition("=")
                if not eq:
                    raise self.fail(f"ENV {w!r}: expected NAME=value")
                pairs[name] = self.expand(value)
        try:
            self.add(spec.SetEnv(spec._env_pairs(pairs)))
        except InvalidArgument as e:
            raise self.fail(str(e)) from None
        self.env.update(pairs)

    def ARG(self, rest: str) -> None:
        for w in self.words(rest):
            name, eq, default = w.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise self.fail(f"ARG {name!r} is not a variable name")
            fallback = self.expand(default) if eq else self.global_args.get(name, "")
            self.args[name] = self.build_args.get(name, fallback)

    def WORKDIR(self, rest: str) -> None:
        words = self.words(rest)
        if len(words) != 1:
            raise self.fail("WORKDIR takes one path")
        path = self.expand(words[0])
        if self.template is not None and not path.startswith("/"):
            path = self.workdir().rstrip("/") + "/" + path
        try:
            self.add(spec.SetWorkdir(spec._abs_path(path.rstrip("/") or "/", "WORKDIR")))
        except InvalidArgument as e:
            raise self.fail(str(e)) from None

    def USER(self, rest: str) -> None:
        words = self.words(rest)
        if len(words) != 1:
            raise self.fail("USER takes one user")
        self.add(spec.SetUser(self.expand(words[0])))

    def run(self, text: str) -> spec.Template:
        for line, word, rest in _instructions(text):
            self.line = line
            if word in IGNORED:
                self.notes.append(f"line {line}: {word} ignored (a sandbox runs no entrypoint or service)")
                continue
            if word in UNSUPPORTED:
                raise self.fail(UNSUPPORTED[word])
            handler = {
                "FROM": self.FROM,
                "RUN": self.RUN,
                "COPY": self.COPY,
                "ADD": self.ADD,
                "ENV": self.ENV,
                "ARG": self.ARG,
                "WORKDIR": self.WORKDIR,
                "USER": self.USER,
            }.get(word)
            if handler is None:
                raise self.fail(f"{word} is not a supported instruction")
            if self.template is None and word not in ("FROM", "ARG"):
                raise self.fail(f"{word} before FROM")
            handler(rest)
        if self.template is None:
            self.line = 0
            raise self.fail("no FROM instruction")
        return dataclasses.replace(self.template, context=self.context, notes=tuple(self.notes))


def parse_dockerfile(
    text: str, *, source: str = "<Dockerfile text>", context: str = "", build_args: Mapping[str, str] | None = None
) -> spec.Template:
    """The Template a Dockerfile's text describes; DockerfileError(line=) for what is not supported."""
    return _Parser(source, context or os.getcwd(), build_args or {}).run(text)
