"""The OpenAPI document of the HTTP API, generated from the route table and the operations' types.

``python -m warmbox.server.openapi > docs/openapi.json`` writes the committed copy (a test checks
it is current, so an API change shows in review); the server serves the same at /v1/openapi.json.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

from warmbox import api, transcript, wire
from warmbox import operations as ops
from warmbox.models import CommandResult, FilesystemEvent
from warmbox.network.policy import Network, Secret

TITLE = "warmbox"
VERSION = "1"


def _overrides(defs: dict[str, Any]) -> dict[str, Any]:
    """Schemas the fields' types do not spell: network's strings ("none", "internet"), secrets (``Any``)."""
    network = {
        "anyOf": [
            {"type": "string", "enum": ["none", "internet"]},
            {"$ref": f"#/components/schemas/{wire.record_schema(Network, defs)}"},
        ],
        "default": "none",
    }
    secret = {"$ref": f"#/components/schemas/{wire.record_schema(Secret, defs)}"}
    # a value alone (a resume's or fork's) keeps the hosts recorded with the sandbox
    value = {"anyOf": [secret, {"type": "string"}]}
    return {
        "network": network,
        "secrets": {"anyOf": [{"type": "object", "additionalProperties": value}, {"type": "null"}]},
    }


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "enum": sorted(wire.ERRORS)},
                    "message": {"type": "string"},
                    "sandbox_id": {"type": ["string", "null"]},
                },
                "required": ["code", "message"],
            }
        },
        "required": ["error"],
    }


def _query_params(cls: type, skip: tuple[str, ...], defs: dict[str, Any]) -> list[dict[str, Any]]:
    import dataclasses

    out = []
    hints = wire.hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("local") or f.name in skip:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append({"name": f.name, "in": "query", "required": required, "schema": wire.schema(hints[f.name], defs)})
    return out


def _export_line(defs: dict[str, Any]) -> dict[str, Any]:
    """One line of an export: the header, or one record of warmbox.transcript.TYPES with its type."""

    def typed(kind: str, schema: dict[str, Any]) -> dict[str, Any]:
        tag = {"type": "object", "properties": {"type": {"const": kind}}, "required": ["type"]}
        return {"allOf": [tag, schema]}

    header = {
        "type": "object",
        "properties": {
            "format": {"const": transcript.FORMAT},
            "sandbox_id": {"type": "string"},
            "exported_at": {"type": "number"},
            "truncated": {"type": "boolean"},
        },
        "required": ["format", "sandbox_id", "exported_at", "truncated"],
    }
    lines = [typed("export", header)]
    lines += [typed(kind, wire.schema(cls, defs)) for kind, cls in transcript.TYPES.items()]
    return {"oneOf": lines}


@functools.cache
def document() -> dict[str, Any]:
    defs: dict[str, Any] = {"Error": _error_schema()}
    overrides = _overrides(defs)
    paths: dict[str, dict[str, Any]] = {}
    errors = {"4XX": {"$ref": "#/components/responses/Error"}, "5XX": {"$ref": "#/components/responses/Error"}}
    for route in api.ROUTES:
        cls = ops.REQUESTS[route.op]
        params: list[dict[str, Any]] = [
            {"name": f, "in": "path", "required": True, "schema": {"type": "string"}} for f in route.path_fields
        ]
        op: dict[str, Any] = {"operationId": route.op.value, "summary": route.summary or route.op.value}
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(f"{cls.__name__}("):
            op["description"] = doc
        if route.body == "json":
            name = wire.record_schema(cls, defs, exclude=route.path_fields, overrides=overrides)
            op["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
        else:
            skip = route.path_fields + (("data",) if route.body == "raw" else ())
            params += _query_params(cls, skip, defs)
            if route.body == "raw":
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                }
        if route.kind == "watch":
            event = wire.schema(FilesystemEvent, defs)
            ok = {
                "description": 'NDJSON: {"watching": path}, then {"event": FilesystemEvent} lines and blank '
                'heartbeat lines, then {"end": null} when the directory goes, or {"error": ...}',
                "content": {
                    "application/x-ndjson": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "watching": {"type": "string"},
                                "event": event,
                                "end": {"type": "null"},
                                "error": defs["Error"]["properties"]["error"],
                            },
                        }
                    }
                },
            }
        elif route.kind == "transcript":
            ok = {
                "description": transcript.__doc__,
                "content": {"application/x-ndjson": {"schema": _export_line(defs)}},
            }
        elif route.response == "ndjson":
            params.append(
                {
                    "name": "stream",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "boolean", "default": False},
                    "description": "send output events while the command runs",
                }
            )
            # events, then how the process ended (a start's first line: {"pid": int})
            following = route.kind in ("follow", "start_follow")
            result = wire.schema(CommandResult if following else wire.result_type(cls), defs)
            ok = {
                "description": 'NDJSON: {"stdout": str} / {"stderr": str} events (with stream=1; '
                'always when following a process, which adds {"pty": base64} and {"lost": bytes}), blank '
                'heartbeat lines, then one {"result": ...} or {"error": ...} line',
                "content": {
                    "application/x-ndjson": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "stdout": {"type": "string"},
                                "stderr": {"type": "string"},
                                "result": result,
                                "error": defs["Error"]["properties"]["error"],
                            },
                        }
                    }
                },
            }
        elif route.response == "websocket":
            ok = {"description": api.TUNNEL_PROTOCOL}
        elif route.response == "raw":
            ok = {
                "description": "the file's bytes",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        else:
            ok = {
                "description": "the operation's result",
                "content": {"application/json": {"schema": wire.schema(wire.result_type(cls), defs)}},
            }
        if route.op in api.KEYED_OPS:
            params = [
                *params,
                {
                    "name": api.IDEMPOTENCY_HEADER,
                    "in": "header",
                    "required": False,
                    "description": "a repeat with the same key gets the first call's result (409 "
                    "idempotency_conflict: the key was used with other arguments)",
                    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                },
            ]
        if params:
            op["parameters"] = params
        op["responses"] = {"101" if route.response == "websocket" else "200": ok, **errors}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": TITLE,
            "version": VERSION,
            "description": "Sandboxes for untrusted code: one route per operation.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(defs.items())),
            "responses": {
                "Error": {
                    "description": "a typed error: its code names the warmbox error class",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                }
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def main() -> None:
    json.dump(document(), sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
