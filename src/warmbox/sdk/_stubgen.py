"""Write ``sdk/__init__.pyi``: the derived sync classes as a type checker should see them.

``synchronize`` builds ``Sandbox`` and friends at import time, so to mypy they would be plain
``type``. The stub states each one's methods with the async signatures made blocking
(``Sandbox.create(...) -> Sandbox``). Run ``python -m warmbox.sdk._stubgen`` after changing the
async API; ``--check`` fails if the committed stub is stale (the test suite runs it).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from warmbox import sdk
from warmbox.sdk import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncFileStream,
    AsyncNetwork,
    AsyncPty,
    AsyncPtyHandle,
    AsyncSandbox,
    AsyncTemplates,
    AsyncWatchHandle,
)
from warmbox.sdk._sync import either

STUB = Path(__file__).with_name("__init__.pyi")
# async class -> sync twin's name (as warmbox.sdk names them)
PAIRS: tuple[tuple[type, str], ...] = (
    (AsyncCommandHandle, "CommandHandle"),
    (AsyncCommands, "Commands"),
    (AsyncFiles, "Files"),
    (AsyncFileStream, "FileStream"),
    (AsyncNetwork, "NetworkAPI"),
    (AsyncPty, "Pty"),
    (AsyncPtyHandle, "PtyHandle"),
    (AsyncSandbox, "Sandbox"),
    (AsyncTemplates, "Templates"),
    (AsyncWatchHandle, "WatchHandle"),
)
# blocking functions of warmbox.sdk written out (not derived from a class)
FUNCTIONS = ("choose_tier",)
_SYNC_NAME = {cls.__name__: name for cls, name in PAIRS}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BUILTIN = {
    "None",
    "str",
    "bytes",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "tuple",
    "object",
    "type",
    "Any",
    "builtins",
}
_KNOWN = {  # type-checking-only imports, and aliases (a union has no module of its own)
    "Network": "warmbox.network.policy",
    "Secret": "warmbox.network.policy",
    "FileData": "warmbox.sdk.files",
    "ProgressSink": "warmbox.operations",
}


def _sync_ann(ann: str) -> str:
    # inside a class with a ``list`` method, ``list[...]`` would name the method: say builtins.list
    ann = re.sub(r"(?<![\w.])list\[", "builtins.list[", ann)
    return _IDENT.sub(lambda m: _SYNC_NAME.get(m.group(0), m.group(0)), ann)


def _params(fn: Any, skip_first: bool) -> str:
    sig = inspect.signature(fn)
    out, star = [], False
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and skip_first:
            out.append(p.name)
            continue
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, star = "*" + p.name, True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
        elif p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.annotation is not inspect.Parameter.empty:
            text += f": {_sync_ann(str(p.annotation))}"
        if p.default is not inspect.Parameter.empty:
            text += " = ..."
        out.append(text)
    return ", ".join(out)


def _ret(fn: Any) -> str:
    ann = inspect.signature(fn).return_annotation
    return "None" if ann is inspect.Signature.empty else _sync_ann(str(ann))


def _class(cls: type, name: str, names: set[str]) -> list[str]:
    lines = [f"class {name}:"]
    doc = (cls.__doc__ or "").strip().splitlines()
    if doc:
        lines.append(f'    """{doc[0]}"""')
    for attr in getattr(cls, "_SYNC_ATTRS", ()):
        sub = {"commands": "Commands", "files": "Files", "network": "NetworkAPI", "pty": "Pty"}[attr]
        lines.append(f"    {attr}: {sub}")
    for attr in sorted(dir(cls)):
        if attr.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, attr)
        if isinstance(raw, either):  # on the class or an instance: a descriptor of its own (_either)
            lines.append(f"    {attr}: _{name}_{attr} = ...")
            names.update(_IDENT.findall(_either(name, attr, raw)))
            continue
        if isinstance(raw, classmethod) and inspect.iscoroutinefunction(raw.__func__):
            fn = raw.__func__
            lines += ["    @classmethod", f"    def {attr}({_params(fn, True)}) -> {_ret(fn)}: ..."]
        elif inspect.iscoroutinefunction(raw):
            variants = typing.get_overloads(raw)  # e.g. run(background=True) -> CommandHandle
            for variant in variants:
                lines += ["    @overload", f"    def {attr}({_params(variant, True)}) -> {_ret(variant)}: ..."]
                names.update(_IDENT.findall(lines[-1].split("(", 1)[-1]))
            if variants:
                continue  # a stub states the overloads only
            lines.append(f"    def {attr}({_params(raw, True)}) -> {_ret(raw)}: ...")
        elif isinstance(raw, property) and raw.fget is not None:
            lines += ["    @property", f"    def {attr}(self) -> {_ret(raw.fget)}: ..."]
        else:
            continue
        names.update(_IDENT.findall(lines[-1].split("(", 1)[-1]))
    if hasattr(cls, "__anext__"):
        nxt = _ret(cls.__anext__)
        lines += [f"    def __iter__(self) -> {name}: ...", f"    def __next__(self) -> {nxt}: ..."]
        names.update(_IDENT.findall(nxt))
    if hasattr(cls, "__aenter__"):
        lines += [f"    def __enter__(self) -> {name}: ...", "    def __exit__(self, *exc: object) -> None: ..."]
    return lines


def _either(name: str, attr: str, raw: either) -> str:
    """The descriptor a stub states for an :class:`either` method: its ``__get__`` gives the
    class's signature on the class and the instance's on an instance."""
    kind = f"_{name}_{attr}"
    out = []
    for side, fn in (("on_class", raw.on_class), ("on_instance", raw.on_instance)):
        params = _params(fn, True).split(", ", 1)
        out += [
            f"class {kind}_{side}(Protocol):",
            f"    def __call__({', '.join(['self', *params[1:]])}) -> {_ret(fn)}: ...",
        ]
    return "\n".join(
        [
            *out,
            f"class {kind}:",
            "    @overload",
            f"    def __get__(self, obj: None, owner: type, /) -> {kind}_on_class: ...",
            "    @overload",
            f"    def __get__(self, obj: object, owner: type | None = ..., /) -> {kind}_on_instance: ...",
        ]
    )


def render() -> str:
    names: set[str] = set()
    body: list[str] = []
    for cls, name in PAIRS:
        for attr in sorted(dir(cls)):
            raw = inspect.getattr_static(cls, attr)
            if isinstance(raw, either):
                body += ["", "", _either(name, attr, raw)]
        body += ["", "", *_class(cls, name, names)]
    for fname in FUNCTIONS:
        fn = getattr(sdk, fname)
        body += ["", "", f"def {fname}({_params(fn, False)}) -> {_ret(fn)}: ..."]
        names.update(_IDENT.findall(body[-1].split("(", 1)[-1]))
    own = {name for _, name in PAIRS}
    imports: dict[str, set[str]] = {}
    for ident in sorted(names - own - _BUILTIN):
        if ident in _KNOWN:
            imports.setdefault(_KNOWN[ident], set()).add(ident)
            continue
        for cls, _ in PAIRS:
            obj = vars(sys.modules[cls.__module__]).get(ident)
            if obj is not None:
                module = getattr(obj, "__module__", None) or cls.__module__
                if isinstance(obj, types.UnionType):  # a type alias: where it is defined
                    module = cls.__module__
                if ident == "Callable":
                    module = "collections.abc"
                imports.setdefault(module, set()).add(ident)
                break
    head = [
        '"""Generated by python -m warmbox.sdk._stubgen from the async SDK: do not edit."""',
        "",
        "import builtins",
        "from collections.abc import Callable as Callable",
        "from typing import Any as Any",
        "from typing import Protocol as Protocol",
        "from typing import overload as overload",
        "",
    ]
    for module in sorted(imports):
        for ident in sorted(imports[module] - {"Callable", "Any", "overload", "Protocol"}):
            head.append(f"from {module} import {ident} as {ident}")
    head += [
        "from warmbox.sdk.code import CodeContext as CodeContext",
        "from warmbox.sdk.commands import AsyncCommandHandle as AsyncCommandHandle, AsyncCommands as AsyncCommands",
        "from warmbox.sdk.files import AsyncFiles as AsyncFiles, AsyncFileStream as AsyncFileStream",
        "from warmbox.sdk.files import AsyncWatchHandle as AsyncWatchHandle",
        "from warmbox.sdk.network import AsyncNetwork as AsyncNetwork",
        "from warmbox.sdk.pty import AsyncPty as AsyncPty, AsyncPtyHandle as AsyncPtyHandle",
        "from warmbox.sdk.sandbox import AsyncSandbox as AsyncSandbox",
        "from warmbox.sdk.templates import AsyncTemplates as AsyncTemplates",
        "from warmbox.sdk.transport import LocalTransport as LocalTransport, Transport as Transport",
        "",
        "__all__ = " + repr(sorted(sdk.__all__)),
    ]
    return "\n".join(dict.fromkeys(head)) + "\n" + "\n".join(body) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not STUB.is_file() or STUB.read_text() != text:
            print(f"{STUB} is stale: run python -m warmbox.sdk._stubgen", file=sys.stderr)
            return 1
        return 0
    STUB.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
