"""The wire form of the one list of operations: typed records <-> JSON, errors <-> a stable ``code``.

One codec for both ends of the HTTP API (``warmbox.server`` and the SDK's HTTP transport), driven
by the same type hints the engine uses — no second set of models. Decoding is strict: an unknown
field, a missing one or a wrong type is an :class:`~warmbox.errors.InvalidArgument` naming the field,
so every route answers bad input the same way. ``bytes`` travel as base64 inside JSON (chart
images); whole files never do (the files routes carry raw bodies).

Errors travel as ``{"code": "sandbox_not_found", "message": ..., <the error's own attributes>}``;
:func:`error_from_wire` raises the same class again on the client, so ``except SandboxNotFound``
works whatever the transport.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

from warmbox import errors
from warmbox import operations as ops
from warmbox.errors import InvalidArgument, WarmboxError

_UNSET = object()
MAX_DEPTH = 8


# ---- values


def loads(raw: bytes | str) -> Any:
    """JSON from a client; nesting too deep for the parser is InvalidArgument. NaN and Infinity
    parse (Python's json writes them), and decode() refuses them naming the field."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument("the request body is nested too deeply") from None


def encode(value: object, tag_bytes: bool = False) -> Any:
    """A typed value (dataclass, enum, bytes, tuple, ...) as JSON-ready data.

    bytes become a base64 string; with ``tag_bytes`` (requests, where a field may be ``str | bytes``)
    ``{"base64": "..."}`` so the server can tell them from text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = base64.b64encode(value).decode()
        return {"base64": text} if tag_bytes else text
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: encode(getattr(value, f.name), tag_bytes)
            for f in dataclasses.fields(value)
            if not f.metadata.get("local") and f.init
        }
    if isinstance(value, dict):
        return {str(k): encode(v, tag_bytes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v, tag_bytes) for v in value]
    raise TypeError(f"cannot encode {type(value).__name__}")


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass's init fields (cached: decoding is on the hot path)."""
    out = _HINTS.get(cls)
    if out is None:
        resolved = typing.get_type_hints(cls)
        out = _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init}
    return out


def _kind(v: object) -> str:
    return "null" if v is None else type(v).__name__


def decode(tp: Any, data: object, where: str = "value", depth: int = 0) -> Any:
    """``data`` (parsed JSON) as a value of type ``tp``; InvalidArgument naming ``where`` otherwise."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{where}: nested too deeply")
    if tp is Any or tp is object:
        return data
    if tp is None or tp is type(None):
        if data is not None:
            raise InvalidArgument(f"{where} must be null, got {_kind(data)}")
        return None
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        failures = []
        objects = []  # an object's failures as the one record (or mapping) it could be: the useful one
        for arg in args:
            if arg is type(None):
                continue
            try:
                return decode(arg, data, where, depth + 1)
            except InvalidArgument as e:
                failures.append(str(e))
                if isinstance(data, dict) and (dataclasses.is_dataclass(arg) or dict in (arg, typing.get_origin(arg))):
                    objects.append(str(e))
        if len(failures) == 1 or len(objects) == 1:
            raise InvalidArgument((objects or failures)[0])
        raise InvalidArgument(f"{where} has the wrong type ({_kind(data)})")
    if origin is Literal:
        if data not in typing.get_args(tp):
            raise InvalidArgument(f"{where} must be one of {list(typing.get_args(tp))}, got {data!r}")
        return data
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(data, list):
            raise InvalidArgument(f"{where} must be a list, got {_kind(data)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(data):
                raise InvalidArgument(f"{where} must have {len(args)} items, got {len(data)}")
            return tuple(
                decode(a, v, f"{where}[{i}]", depth + 1) for i, (a, v) in enumerate(zip(args, data, strict=True))
            )
        item = args[0] if args else Any
        out = [decode(item, v, f"{where}[{i}]", depth + 1) for i, v in enumerate(data)]
        return out if origin is list or tp is list else tuple(out)
    if origin is dict or tp is dict:
        if not isinstance(data, dict):
            raise InvalidArgument(f"{where} must be an object, got {_kind(data)}")
        kt, vt = typing.get_args(tp) or (str, Any)
        return {
            decode(kt, k, f"{where} key", depth + 1): decode(vt, v, f"{where}[{k!r}]", depth + 1)
            for k, v in data.items()
        }
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            try:
                return tp(data)
            except ValueError:
                raise InvalidArgument(f"{where} must be one of {[m.value for m in tp]}, got {data!r}") from None
        if tp is bool:
            if not isinstance(data, bool):
                raise InvalidArgument(f"{where} must be true or false, got {_kind(data)}")
            return data
        if tp is int:
            if isinstance(data, bool) or not isinstance(data, int):
                raise InvalidArgument(f"{where} must be an integer, got {_kind(data)}")
            return data
        if tp is float:
            if isinstance(data, bool) or not isinstance(data, (int, float)):
                raise InvalidArgument(f"{where} must be a number, got {_kind(data)}")
            try:
                value = float(data)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                raise InvalidArgument(f"{where} must be a finite number")
            return value
        if tp is str:
            if not isinstance(data, str):
                raise InvalidArgument(f"{where} must be a string, got {_kind(data)}")
            return data
        if tp is bytes:
            if isinstance(data, dict) and set(data) == {"base64"}:
                data = data["base64"]
            if not isinstance(data, str):
                raise InvalidArgument(f"{where} must be a base64 string, got {_kind(data)}")
            try:
                return base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgument(f"{where} is not valid base64") from None
        if dataclasses.is_dataclass(tp):
            return decode_record(tp, data, where, depth + 1)
    raise InvalidArgument(f"{where}: no wire form for {tp!r}")


def decode_record(cls: type, data: object, where: str = "body", depth: int = 0, /, **given: Any) -> Any:
    """A dataclass from a JSON object: unknown fields and missing required ones are refused.
    ``given``: fields taken from elsewhere (the route's path), which the body must not repeat."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where} must be a JSON object, got {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("local")}
    unknown = sorted(k for k in data if k not in fields or k in given)
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        )
    h = hints(cls)
    kwargs: dict[str, Any] = dict(given)
    prefix = "" if where in ("body", "query") else f"{where}."
    for name, f in fields.items():
        if name in given:
            continue
        if name in data:
            kwargs[name] = decode(h[name], data[name], prefix + name, depth)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InvalidArgument(f"{prefix}{name} is required")
    try:
        return cls(**kwargs)
    except WarmboxError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{where}: {e}") from None


def result_type(request_cls: type[ops.Request[Any]]) -> Any:
    """R of ``Request[R]``: what the operation returns."""
    for base in getattr(request_cls, "__orig_bases__", ()):
        if typing.get_origin(base) is ops.Request:
            return typing.get_args(base)[0]
    raise TypeError(f"{request_cls.__name__} is not a Request[...]")


# ---- errors


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _error_classes() -> dict[str, type[WarmboxError]]:
    out: dict[str, type[WarmboxError]] = {}
    stack: list[type[WarmboxError]] = [WarmboxError]
    while stack:
        cls = stack.pop()
        if cls.__module__ == errors.__name__:
            out[_snake(cls.__name__)] = cls
        stack.extend(cls.__subclasses__())
    return out


ERRORS: dict[str, type[WarmboxError]] = _error_classes()
"""code -> error class, for every class in warmbox.errors."""
CODES: dict[type[WarmboxError], str] = {cls: code for code, cls in ERRORS.items()}
_ATTRS = (
    "sandbox_id",
    "tier",
    "reason",
    "limit",
    "value",
    "maximum",
    "source",
    "retry_after",
    "language",
    "available",
    "template",
    "step",
    "log",
    "line",
    "volume",
    "missing",
    "rejected",
    "approval_id",
    "state",
    "node",
    "recorded",
    "runtime",
    "registry",
)


def error_code(exc: WarmboxError) -> str:
    """The stable code of an error: its nearest warmbox.errors class, in snake case."""
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return "warmbox_error"


def error_to_wire(exc: WarmboxError) -> dict[str, Any]:
    out: dict[str, Any] = {"code": error_code(exc), "message": str(exc)}
    for name in _ATTRS:
        v = getattr(exc, name, _UNSET)
        if v is not _UNSET and (v is None or isinstance(v, (str, int, float, bool))):
            out[name] = v
        elif isinstance(v, tuple) and all(isinstance(x, str) for x in v):
            out[name] = list(v)
    return out


def error_from_wire(data: object, fallback: Callable[[str], WarmboxError] | None = None) -> WarmboxError:
    """The same error class the server raised, with its message and attributes."""
    if not isinstance(data, dict) or not isinstance(data.get("code"), str):
        return (fallback or WarmboxError)(f"the server sent an unreadable error: {str(data)[:200]!r}")
    cls = ERRORS.get(data["code"], WarmboxError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(data.get("message", "")))
    for name in _ATTRS:
        if name in data:
            v = data[name]
            setattr(exc, name, tuple(str(x) for x in v) if isinstance(v, list) else v)
    if isinstance(exc, errors.SandboxError) and not hasattr(exc, "sandbox_id"):
        exc.sandbox_id = None
    return exc


# ---- JSON Schema (for the OpenAPI document)


def schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema of a type; dataclasses go to ``defs`` and are referenced."""
    if tp is Any or tp is object:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return {"anyOf": [schema(a, defs) for a in typing.get_args(tp)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [schema(a, defs) for a in args], "minItems": len(args)}
        return {"type": "array", "items": schema(args[0], defs) if args else {}}
    if origin is dict or tp is dict:
        args = typing.get_args(tp)
        return {"type": "object", "additionalProperties": schema(args[1], defs) if args else {}}
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return {"type": "string", "enum": [m.value for m in tp]}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if tp in simple:
            return {"type": simple[tp]}
        if tp is bytes:
            b64 = {"type": "string", "contentEncoding": "base64"}
            return {"anyOf": [b64, {"type": "object", "properties": {"base64": b64}, "required": ["base64"]}]}
        if dataclasses.is_dataclass(tp):
            return {"$ref": f"#/components/schemas/{record_schema(tp, defs)}"}
    if callable(tp) and not isinstance(tp, type):  # a TypeAlias of a callable (never on the wire)
        return {}
    raise TypeError(f"no schema for {tp!r}")


def record_schema(
    cls: type, defs: dict[str, Any], exclude: tuple[str, ...] = (), overrides: dict[str, Any] | None = None
) -> str:
    """Put the object schema of a dataclass into ``defs``; returns its name. ``exclude``: fields
    not in the body (path parameters); ``overrides``: schemas of fields typed ``object``."""
    name = cls.__name__ if not exclude else f"{cls.__name__}Body"
    if name in defs:
        return name
    defs[name] = {}  # recursion guard
    props: dict[str, Any] = {}
    required: list[str] = []
    h = hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("local") or f.name in exclude:
            continue
        props[f.name] = (overrides or {}).get(f.name) or schema(h[f.name], defs)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        elif f.default is not dataclasses.MISSING and isinstance(f.default, (str, int, float, bool)):
            props[f.name] = {**props[f.name], "default": f.default}
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(f"{cls.__name__}("):
        out["description"] = doc
    defs[name] = out
    return name


__all__ = [
    "CODES",
    "loads",
    "ERRORS",
    "decode",
    "decode_record",
    "encode",
    "error_code",
    "error_from_wire",
    "error_to_wire",
    "result_type",
    "schema",
]
