"""The template spec: an image source and flat typed steps, built up by an immutable fluent API.

Each method returns a new :class:`Template`; nothing runs until it is built (``warmbox template
build``, :func:`warmbox.sdk.build_template`). The records here are the wire form too: a build
request carries the spec as these records, and the engine's cache key of each step is computed
from them (:mod:`warmbox.templates.keys`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from warmbox.errors import InvalidArgument
from warmbox.models import record

VENV = "/opt/venv"  # where pip_install installs: root-owned, on the image's PATH
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_PACKAGE_RE = re.compile(r"^[A-Za-z0-9@][A-Za-z0-9@._+:/=<>!~,*\[\]-]{0,199}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SUITE_RE = re.compile(r"^[a-z][a-z0-9-]{1,30}$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$|^[0-9]{1,9}$")
_REF_RE = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?/[a-z0-9._/-]+(:[A-Za-z0-9._-]{1,128})?(@sha256:[0-9a-f]{64})?")
MAX_STEPS = 200
MAX_TEXT = 64 << 10  # one RUN command or warm-up, characters


# ---- image sources


@record
class DebianSource:
    """A Debian root filesystem made with mmdebstrap (``packages``: extra ones installed with it)."""

    suite: str
    packages: tuple[str, ...] = ()
    kind: Literal["debian"] = "debian"


@record
class BuiltSource:
    """A template already built on this host (a built-in one such as ``base``, or a user's)."""

    name: str
    kind: Literal["template"] = "template"


@record
class OciSource:
    """An OCI image layout directory or archive (``podman save``/``docker save`` style) on the
    engine's host."""

    path: str
    kind: Literal["oci"] = "oci"


@record
class RegistrySource:
    """An image in a registry, ``host[:port]/name[:tag]``, pulled with skopeo (a Docker Hub name
    such as ``python:3.11-slim`` is kept as ``docker.io/library/python:3.11-slim``)."""

    ref: str
    tls_verify: bool = True
    kind: Literal["registry"] = "registry"


Source = DebianSource | BuiltSource | OciSource | RegistrySource


# ---- steps (one cached layer each, or a change of the image's config)


@record
class AptInstall:
    """``apt-get install -y --no-install-recommends`` the packages (the lists are removed after)."""

    packages: tuple[str, ...]
    kind: Literal["apt"] = "apt"


@record
class PipInstall:
    """``pip install`` into the image's venv (:data:`VENV`, system site packages visible; on PATH,
    and visible to a sandbox's own venv). index_url / find_links: where from ("" = pip's default)."""

    packages: tuple[str, ...]
    index_url: str = ""
    find_links: str = ""
    kind: Literal["pip"] = "pip"


@record
class NpmInstall:
    """``npm install`` the packages, globally (``/usr/local``) or into the working directory."""

    packages: tuple[str, ...]
    global_: bool = True
    kind: Literal["npm"] = "npm"


@record
class Run:
    """A command run as root in the build sandbox: ``shell`` (bash -c) or ``argv`` (exec form)."""

    shell: str = ""
    argv: tuple[str, ...] = ()
    kind: Literal["run"] = "run"


@record
class Copy:
    """Local files into the image: each of ``sources`` (relative to the build context, or
    absolute on the client) to ``dest``. A directory's contents are copied; a file lands at
    ``dest`` (in it, if ``dest`` ends with '/' or there are several sources). chown: "uid[:gid]"
    (numeric) or "" (root)."""

    sources: tuple[str, ...]
    dest: str
    chown: str = ""
    kind: Literal["copy"] = "copy"


@record
class SetEnv:
    """Environment variables of the image (later steps and every sandbox see them)."""

    pairs: tuple[tuple[str, str], ...]
    kind: Literal["env"] = "env"


@record
class SetWorkdir:
    """The working directory of later steps and of the image's sandboxes (made if missing)."""

    path: str
    kind: Literal["workdir"] = "workdir"


@record
class SetUser:
    """The user later RUN steps run as, and the image's default user."""

    name: str
    kind: Literal["user"] = "user"


Step = AptInstall | PipInstall | NpmInstall | Run | Copy | SetEnv | SetWorkdir | SetUser
LAYER_STEPS = (AptInstall, PipInstall, NpmInstall, Run, Copy)  # the rest change the config only


@record
class BuildNetwork:
    """The build's egress: "none" (default), "internet", or "allowlist" of host patterns."""

    mode: Literal["none", "allowlist", "internet"] = "none"
    allow: tuple[str, ...] = ()


def describe(step: Step) -> str:
    """A step in one line, Dockerfile-like (progress, errors, logs)."""
    if isinstance(step, AptInstall):
        return "APT " + " ".join(step.packages)
    if isinstance(step, PipInstall):
        return "PIP " + " ".join(step.packages)
    if isinstance(step, NpmInstall):
        return "NPM " + ("-g " if step.global_ else "") + " ".join(step.packages)
    if isinstance(step, Run):
        text = step.shell or " ".join(step.argv)
        text = text.replace("\n", " ")
        return "RUN " + (text if len(text) <= 100 else text[:97] + "...")
    if isinstance(step, Copy):
        return "COPY " + " ".join(step.sources) + " " + step.dest
    if isinstance(step, SetEnv):
        return "ENV " + " ".join(f"{k}={v}" for k, v in step.pairs)
    if isinstance(step, SetWorkdir):
        return "WORKDIR " + step.path
    return "USER " + step.name


def describe_source(source: Source) -> str:
    if isinstance(source, DebianSource):
        return f"debian:{source.suite}" + (f" +{','.join(source.packages)}" if source.packages else "")
    if isinstance(source, BuiltSource):
        return source.name
    if isinstance(source, OciSource):
        return f"oci-archive:{source.path}"
    return source.ref


# ---- validation


def _text(value: object, what: str, limit: int = 4096) -> str:
    if not isinstance(value, str) or not value or "\0" in value or len(value) > limit:
        raise InvalidArgument(f"{what} must be a non-empty string without NUL bytes (at most {limit} characters)")
    return value


def _packages(packages: object, what: str) -> tuple[str, ...]:
    if isinstance(packages, str):
        packages = [packages]
    if not isinstance(packages, Iterable):
        raise InvalidArgument(f"{what} must be a list of package names")
    out = tuple(packages)
    if not out:
        raise InvalidArgument(f"{what} must name at least one package")
    for p in out:
        if not isinstance(p, str) or not _PACKAGE_RE.match(p):
            raise InvalidArgument(f"{what}: {p!r} is not a package name or requirement")
    return out


def _abs_path(value: object, what: str) -> str:
    path = _text(value, what)
    if not path.startswith("/"):
        raise InvalidArgument(f"{what} must be an absolute path, got {path!r}")
    if ".." in path.split("/"):
        raise InvalidArgument(f"{what} must not contain '..', got {path!r}")
    return path


def _env_pairs(env: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(env, Mapping) or not env:
        raise InvalidArgument("env takes a non-empty mapping of names to values")
    out = []
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME_RE.match(k):
            raise InvalidArgument(f"env: {k!r} is not a variable name")
        if not isinstance(v, str) or "\0" in v or len(v) > MAX_TEXT:
            raise InvalidArgument(f"env: the value of {k} must be a string without NUL bytes")
        out.append((k, v))
    return tuple(out)


def check_chown(chown: str) -> str:
    """ "" / "root" / "uid" / "uid:gid" (numeric): the form COPY supports."""
    if chown in ("", "root", "root:root", "0", "0:0"):
        return ""
    if re.fullmatch(r"[0-9]{1,5}(:[0-9]{1,5})?", chown) and all(int(x) < 65536 for x in chown.split(":")):
        return chown
    raise InvalidArgument(f"chown must be numeric uid[:gid] below 65536 (or root), got {chown!r}")


def check_step(step: object) -> Step:
    """A step as received (SDK, wire): its fields checked, or InvalidArgument naming what is wrong."""
    if isinstance(step, AptInstall):
        _packages(step.packages, "apt_install")
    elif isinstance(step, PipInstall):
        _packages(step.packages, "pip_install")
        for what, v in (("index_url", step.index_url), ("find_links", step.find_links)):
            if v:
                _text(v, f"pip_install {what}")
    elif isinstance(step, NpmInstall):
        _packages(step.packages, "npm_install")
    elif isinstance(step, Run):
        if bool(step.shell) == bool(step.argv):
            raise InvalidArgument("run takes a shell command or an argv list (one of them)")
        if step.shell:
            _text(step.shell, "run", MAX_TEXT)
        else:
            for a in step.argv:
                if not isinstance(a, str) or "\0" in a:
                    raise InvalidArgument("run: argv items must be strings without NUL bytes")
    elif isinstance(step, Copy):
        if not step.sources:
            raise InvalidArgument("copy needs a source")
        for s in step.sources:
            _text(s, "copy source")
        _abs_path(step.dest, "copy destination")
        check_chown(step.chown)
    elif isinstance(step, SetEnv):
        _env_pairs(dict(step.pairs))
    elif isinstance(step, SetWorkdir):
        _abs_path(step.path, "workdir")
    elif isinstance(step, SetUser):
        if not isinstance(step.name, str) or not _USER_RE.match(step.name.split(":")[0]):
            raise InvalidArgument(f"user must be a user name or uid, got {step.name!r}")
    else:
        raise InvalidArgument(f"not a template step: {type(step).__name__}")
    return step


def check_source(source: object) -> Source:
    if isinstance(source, DebianSource):
        if not isinstance(source.suite, str) or not _SUITE_RE.match(source.suite):
            raise InvalidArgument(f"debian suite must be a name like 'bookworm', got {source.suite!r}")
        if source.packages:
            _packages(source.packages, "debian packages")
    elif isinstance(source, BuiltSource):
        check_name(source.name)
    elif isinstance(source, OciSource):
        _text(source.path, "from_oci path")
    elif isinstance(source, RegistrySource):
        if not isinstance(source.ref, str) or not _REF_RE.fullmatch(source.ref):
            raise InvalidArgument(f"from_registry takes [host[:port]/]name[:tag] (lowercase name), got {source.ref!r}")
    else:
        raise InvalidArgument(f"not an image source: {type(source).__name__}")
    return source


DOCKER_HUB = "docker.io"


def docker_reference(image: str) -> str:
    """``image`` with its registry host, as Docker resolves it: a first component without '.' or
    ':' that is not ``localhost`` names no host, so the image is on Docker Hub (``docker.io``),
    and a one-component name is one of its official images (``library/``)."""
    if not isinstance(image, str):
        return image
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"{DOCKER_HUB}/{image}" if slash else f"{DOCKER_HUB}/library/{image}"


_MIRROR_RE = re.compile(r"(https?://)?([A-Za-z0-9.-]+(:[0-9]{1,5})?)(/[a-z0-9._-]+)*/?")


def check_mirror(mirror: str) -> str:
    """A registry mirror of Docker Hub: ``[https://|http://]host[:port][/prefix]`` (http: plain
    HTTP, as a local mirror may be); InvalidArgument otherwise."""
    if not isinstance(mirror, str) or not _MIRROR_RE.fullmatch(mirror) or ".." in mirror:
        raise InvalidArgument(f"a registry mirror is [https://|http://]host[:port][/prefix], got {str(mirror)[:200]!r}")
    return mirror


def through_mirror(ref: str, tls_verify: bool, mirror: str) -> tuple[str, bool]:
    """Where ``ref`` is pulled from: a Docker Hub image from ``mirror`` (if set; its path prefix
    before the image's name, plain HTTP for an http:// mirror), anything else from its own host."""
    host, _, name = ref.partition("/")
    if not mirror or host != DOCKER_HUB:
        return ref, tls_verify
    check_mirror(mirror)
    plain = mirror.startswith("http://")
    base = mirror.partition("://")[2] if "://" in mirror else mirror
    return base.rstrip("/") + "/" + name, tls_verify and not plain


def check_name(name: object) -> str:
    """A template name: lowercase letters, digits, '.', '_', '-' (at most 63; E2B/Docker-like)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidArgument(f"template name must be lowercase letters, digits, '.', '_' or '-' (1-63), got {name!r}")
    return name


# ---- the fluent spec


@record
class Template:
    """An image definition: a source, then steps in order. Immutable: every method returns a new one.

    >>> Template.debian("bookworm").apt_install(["git"]).pip_install(["requests"]).env({"A": "1"})

    context: the directory COPY sources are relative to, on the caller's side (a Dockerfile's own
    directory unless given; else the current directory at build time). It travels as a tar of the
    copied files, never as a path the engine opens.
    """

    source: Source
    steps: tuple[Step, ...] = ()
    build_network: BuildNetwork = BuildNetwork()
    warmup_code: str | None = None
    warmup_commands: tuple[str, ...] = ()
    context: str = dataclasses.field(default="", compare=False, metadata={"local": True})
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # what a parser ignored

    # -- sources

    @classmethod
    def debian(cls, suite: str = "bookworm", packages: Sequence[str] = ()) -> Template:
        """A Debian ``suite`` root filesystem (mmdebstrap, minbase), with ``packages`` and python3
        (the guest agent's interpreter) installed."""
        return cls(check_source(DebianSource(suite, tuple(packages))))

    @classmethod
    def from_template(cls, name: str) -> Template:
        """On top of a template built on this host (built-in ``base``, or one of yours)."""
        return cls(check_source(BuiltSource(name)))

    @classmethod
    def from_oci(cls, path: str | os.PathLike[str]) -> Template:
        """An OCI image layout directory or archive (docker/podman save) on the engine's host."""
        return cls(check_source(OciSource(os.fspath(path))))

    @classmethod
    def from_registry(cls, ref: str, *, tls_verify: bool = True) -> Template:
        """An image in a registry, ``host[:port]/name[:tag]`` (pulled with skopeo). A name without
        a registry host resolves as Docker does: ``python:3.11-slim`` is
        ``docker.io/library/python:3.11-slim``, pulled through ``[templates] registry_mirror`` if set."""
        return cls(check_source(RegistrySource(docker_reference(ref), bool(tls_verify))))

    @classmethod
    def from_dockerfile(
        cls, path_or_text: str | os.PathLike[str], *, context: str | os.PathLike[str] | None = None
    ) -> Template:
        """A Dockerfile (a path, or its text if it contains a newline), the supported subset (see
        :mod:`warmbox.templates.dockerfile`); DockerfileError(line=) for anything else. context:
        COPY's base directory (default: the Dockerfile's directory, or the current one for text)."""
        from warmbox.templates.dockerfile import parse_dockerfile, read_dockerfile

        text, source, where = read_dockerfile(path_or_text)
        ctx = os.fspath(context) if context is not None else where
        return parse_dockerfile(text, source=source, context=ctx)

    # -- steps

    def _add(self, step: Step) -> Template:
        if len(self.steps) >= MAX_STEPS:
            raise InvalidArgument(f"a template has at most {MAX_STEPS} steps")
        return dataclasses.replace(self, steps=(*self.steps, check_step(step)))

    def apt_install(self, packages: Sequence[str] | str) -> Template:
        return self._add(AptInstall(_packages(packages, "apt_install")))

    def pip_install(
        self, packages: Sequence[str] | str, *, index_url: str | None = None, find_links: str | None = None
    ) -> Template:
        return self._add(PipInstall(_packages(packages, "pip_install"), index_url or "", find_links or ""))

    def npm_install(self, packages: Sequence[str] | str, global_: bool = True, **kw: bool) -> Template:
        """``global`` is a keyword of Python: pass ``global_=`` or ``**{"global": ...}``."""
        unknown = set(kw) - {"global"}
        if unknown:
            raise InvalidArgument(f"npm_install: unknown argument(s) {sorted(unknown)}")
        g = kw.get("global", global_)
        return self._add(NpmInstall(_packages(packages, "npm_install"), bool(g)))

    def run(self, command: str | Sequence[str]) -> Template:
        """A shell command (string: bash -c) or an argv list, run as the current user (root unless
        :meth:`user` said otherwise)."""
        if isinstance(command, str):
            return self._add(Run(shell=command))
        return self._add(Run(argv=tuple(command)))

    def run_commands(self, *commands: str) -> Template:
        """Modal/Daytona-style: each command a step of its own."""
        t = self
        for c in commands:
            t = t.run(c)
        return t

    def copy(
        self, local: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], remote: str, *, chown: str = ""
    ) -> Template:
        if isinstance(local, (str, os.PathLike)):
            sources: tuple[str, ...] = (os.fspath(local),)
        else:
            sources = tuple(os.fspath(s) for s in local)
        return self._add(Copy(sources, remote, check_chown(chown)))

    def env(self, envs: Mapping[str, str]) -> Template:
        return self._add(SetEnv(_env_pairs(envs)))

    def workdir(self, path: str) -> Template:
        return self._add(SetWorkdir(_abs_path(path, "workdir")))

    def user(self, name: str) -> Template:
        return self._add(SetUser(name))

    # -- not layers

    def warmup(self, code: str | None = None, commands: Sequence[str] = ()) -> Template:
        """What each sandbox of the template runs before it is handed out (a pool pays it ahead):
        Python ``code`` in the default code context, shell ``commands`` in order (each must exit 0)."""
        if code is not None and (not isinstance(code, str) or len(code) > MAX_TEXT):
            raise InvalidArgument("warmup code must be a string")
        cmds = tuple(commands)
        for c in cmds:
            _text(c, "warmup command", MAX_TEXT)
        return dataclasses.replace(self, warmup_code=code, warmup_commands=cmds)

    def network(self, policy: object, *, secrets: object = None) -> Template:
        """The build's egress (RUN/apt/pip/npm steps): "none" (default), "internet", a list of host
        patterns, or a :class:`warmbox.Network` (its allow list). A build takes no secrets: any
        given are refused (InvalidArgument), never dropped. The policy is part of each such step's
        cache key: another network runs the step again."""
        return dataclasses.replace(self, build_network=to_build_network(policy, secrets))

    def with_context(self, context: str | os.PathLike[str]) -> Template:
        return dataclasses.replace(self, context=os.fspath(context))

    # -- reading

    def layer_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if isinstance(s, LAYER_STEPS))

    def describe(self) -> list[str]:
        return ["FROM " + describe_source(self.source)] + [describe(s) for s in self.steps]


NO_BUILD_SECRETS = (
    "a template build takes no secrets: what its steps fetch or write becomes a layer that every "
    "sandbox of the template reads. Give secrets to the sandboxes (Sandbox.create(secrets=...)), "
    "or COPY what the build needs from the build context"
)


def to_build_network(policy: object, secrets: object = None) -> BuildNetwork:
    """A build's network as its record; InvalidArgument for anything a build cannot honour (deny
    rules, ``on_unknown="ask"``, secrets) rather than a policy quietly narrower than the one asked."""
    if secrets is not None and secrets != {} and secrets != ():
        raise InvalidArgument(NO_BUILD_SECRETS)
    if isinstance(policy, Mapping) and "secrets" in policy:
        raise InvalidArgument(NO_BUILD_SECRETS)
    if isinstance(policy, BuildNetwork):
        return policy
    if policy in ("none", None):
        return BuildNetwork()
    if policy == "internet":
        return BuildNetwork("internet")
    if isinstance(policy, (list, tuple)):
        hosts = tuple(policy)
    else:
        from warmbox.network.policy import Network  # a sibling core module (errors only)

        if not isinstance(policy, Network):
            raise InvalidArgument(
                f'network must be "none", "internet", a list of hosts or a warmbox.Network, got {policy!r}'
            )
        if policy.deny:
            raise InvalidArgument("a build's network takes an allow list only (deny rules are not supported)")
        if policy.on_unknown != "deny":
            raise InvalidArgument(
                "a build's network cannot ask about unknown hosts (no one answers during a build): "
                "on_unknown must be 'deny'"
            )
        hosts = tuple(policy.allow)
    for h in hosts:
        _text(h, "network host", 253)
    return BuildNetwork("allowlist", hosts) if hosts else BuildNetwork()


def check_template(t: object) -> Template:
    """A spec as received (wire, SDK): every record checked."""
    if not isinstance(t, Template):
        raise InvalidArgument(f"expected a warmbox Template, got {type(t).__name__}")
    check_source(t.source)
    if len(t.steps) > MAX_STEPS:
        raise InvalidArgument(f"a template has at most {MAX_STEPS} steps")
    for s in t.steps:
        check_step(s)
    to_build_network(t.build_network)
    if t.warmup_code is not None or t.warmup_commands:
        t.warmup(t.warmup_code, t.warmup_commands)
    return t
