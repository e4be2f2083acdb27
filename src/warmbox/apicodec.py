"""An operation as the HTTP request of warmbox's API (route, query, JSON body: checked as the engine
would check them), and an error answer as its typed WarmboxError. Both clients of a server use it:
the SDK's HTTP transport (aiohttp) and the CLI's thin path (the standard library). No I/O here."""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import typing
from typing import Any

from warmbox import api, wire
from warmbox import operations as ops
from warmbox.errors import ContextError, InvalidArgument, SandboxNotFound, WarmboxError


def sinks(request: ops.Request[Any]) -> tuple[ops.TextSink | None, ops.TextSink | None]:
    if isinstance(request, (ops.Exec, ops.RunCode, ops.CreateAndRun)):
        return request.on_stdout, request.on_stderr
    return None, None


def _query(fields: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in fields.items():
        if isinstance(v, (dict, list)):  # a record (list's query) travels as one JSON value
            out[k] = json.dumps(v, separators=(",", ":"))
            continue
        out[k] = "null" if v is None else ("true" if v is True else "false" if v is False else str(v))
    return out


def _cls(request: ops.Request[Any]) -> type:
    return type(request)


def _check_path_fields(request: ops.Request[Any], route: api.Route) -> None:
    """An id in the URL's path must be one segment: the server decodes %2F before it matches a
    route, and ".." would be resolved away, so "../../etc" would reach no route (or another one).
    No real id is like that; refused with the error the engine gives such an id."""
    for name in route.path_fields:
        value = getattr(request, name)
        if isinstance(value, str) and value and "/" not in value and value not in (".", ".."):
            continue
        if name == "sandbox_id":
            raise SandboxNotFound(f"no sandbox {value!r} (ids look like sb-0123456789ab)", str(value))
        if isinstance(request, (ops.RemoveContext, ops.RestartContext)):
            raise ContextError(f"no code context {value!r}", request.sandbox_id)
        raise InvalidArgument(f"{value!r} is not a valid {name.replace('_', ' ')}")


def _check_records(request: ops.Request[Any]) -> None:
    """A field typed as a record (limits: Limits) must hold one, as in process: encoded, a dict of
    the same fields would pass for it, so code that works over HTTP would fail in process."""
    for name, tp in wire.hints(_cls(request)).items():
        value = getattr(request, name)
        alternatives = typing.get_args(tp) or (tp,)
        records: tuple[type, ...] = tuple(
            a for a in alternatives if isinstance(a, type) and dataclasses.is_dataclass(a)
        )
        # a plain value the field also takes (network: Network | str) is the codec's to check
        plain = tuple(a for a in alternatives if a in (str, int, float, bool))
        items: list[tuple[str, object]] = [(name, value)]
        if records and typing.get_origin(tp) is tuple:  # a list of records (files.write_files): each item
            if not isinstance(value, (list, tuple)):
                raise InvalidArgument(f"{name} must be a list, got {type(value).__name__}")
            items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        for where, v in items:
            if records and v is not None and not isinstance(v, records + plain):
                raise InvalidArgument(f"{where} must be a warmbox.{records[0].__name__}, got {type(v).__name__}")


def _is_path(field: str) -> bool:
    """A sandbox path of the files API (path, old_path, new_path, ...)."""
    return field == "path" or field.endswith("_path")


def _checked(request: ops.Request[Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Fields bound for a query string, checked here: the query carries text, so a value of the
    wrong type (path=42) would arrive as its str() and be taken. Refused as in process: a path by
    the engine's own check (InvalidPath), anything else by the codec (InvalidArgument)."""
    hints = wire.hints(_cls(request))
    for name, value in fields.items():
        if _is_path(name):
            ops.sandbox_path(value)
        else:
            wire.decode(hints[name], value, name)
    return fields


def build(request: ops.Request[Any]) -> tuple[api.Route, dict[str, Any]]:
    route = api.BY_OP[request.op]
    _check_path_fields(request, route)
    _check_records(request)
    if isinstance(request, (ops.WriteFile, ops.WriteFileStream, ops.UploadDir)):  # the raw body: never base64
        fields = {
            f.name: wire.encode(getattr(request, f.name), tag_bytes=True)
            for f in dataclasses.fields(request)
            if f.name != "data"
        }
    else:
        fields = wire.encode(request, tag_bytes=True)
    for f in route.path_fields:
        fields.pop(f, None)
    kwargs: dict[str, Any] = {}
    if route.body == "json":
        for name in fields:  # refused as in process (InvalidPath), not by the codec's type check
            if _is_path(name):
                ops.sandbox_path(getattr(request, name))
        kwargs["data"] = json.dumps(fields, separators=(",", ":"))
        kwargs["headers"] = {"Content-Type": "application/json"}
    elif route.body == "query":
        kwargs["params"] = _query(_checked(request, fields))
    else:  # raw: the data is the body
        fields.pop("data", None)
        data = request.data if isinstance(request, (ops.WriteFile, ops.WriteFileStream, ops.UploadDir)) else b""
        if route.streamed:  # sent as taken (chunked), never held
            if not isinstance(data, collections.abc.AsyncIterator):
                raise InvalidArgument(f"data must be an async iterator of bytes, got {type(data).__name__}")
            kwargs["data"] = data
        elif isinstance(data, str):
            kwargs["data"] = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            kwargs["data"] = bytes(data)
        else:
            raise InvalidArgument(f"data must be str or bytes, got {type(data).__name__}")
        kwargs["params"] = _query(_checked(request, fields))
    wants_results = isinstance(request, (ops.RunCode, ops.CreateAndRun)) and request.on_result is not None
    wants_results |= isinstance(request, ops.TemplateBuild) and request.on_progress is not None
    if route.response == "ndjson" and (wants_results or any(s is not None for s in sinks(request))):
        kwargs["params"] = {"stream": "1"}
    return route, kwargs


def error(status: int, body: bytes) -> WarmboxError:
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            return wire.error_from_wire(data.get("error"))
    except ValueError:
        pass
    text = body[:200].decode(errors="replace")
    if status in (400, 413, 414, 431):
        return InvalidArgument(f"the server refused the request (HTTP {status}): {text}")
    return WarmboxError(f"the server answered HTTP {status}: {text}")
