"""E2B's code interpreter (port 49999) as operations: ``POST /execute`` streams its NDJSON events
(stdout/stderr with timestamps, results with their MIME fields, the error, the execution count,
the end) from ``run_code``; ``/contexts`` creates, lists, restarts and removes code contexts."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from warmbox import operations as ops
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.models import Execution, Result
from warmbox.server.e2b.common import (
    HOME,
    Service,
    Target,
    Tokens,
    answer,
    data_target,
    e2b_path,
    error_response,
    json_body,
)

MAX_JSON = 16 << 20  # an /execute body (the code is the largest thing in it)
FLUSH_S = 0.05  # a partial line of output waits at most this long for the rest of it
FLUSH_BYTES = 64 << 10
_MIME = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "javascript")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def result_event(r: Result) -> dict[str, Any]:
    """A warmbox result as E2B's ``result`` event (``json`` as an object, as E2B sends it)."""
    out: dict[str, Any] = {"type": "result", "is_main_result": r.is_main_result}
    for name in _MIME:
        value = getattr(r, name)
        if value is not None:
            out[name] = value
    if r.json is not None:
        try:
            out["json"] = json.loads(r.json)
        except ValueError:
            out["json"] = r.json
    return out


def end_events(got: Execution) -> list[dict[str, Any]]:
    """What follows a run's output: its results, its error, its execution count, the end."""
    events = [result_event(r) for r in got.results]
    if got.error is not None:
        events.append({"type": "error", **{k: getattr(got.error, k) for k in ("name", "value", "traceback")}})
    elif got.timed_out:
        events.append({"type": "error", "name": "TimeoutError", "value": "the execution timed out", "traceback": ""})
    events.append({"type": "number_of_executions", "execution_count": got.execution_count})
    events.append({"type": "end_of_execution"})
    return events


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a string, got {type(value).__name__}")
    return value


class Interpreter:
    """The code-interpreter plane of every sandbox."""

    def __init__(self, service: Service, tokens: Tokens) -> None:
        self._service = service
        self._tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer(self._route, scope, receive, send)

    async def _route(self, request: Request) -> Response:
        method, parts = request.method, [p for p in request.url.path.split("/") if p]
        if parts == ["health"] and method == "GET":
            return Response(status_code=200)
        t = data_target(self._service, self._tokens, request.headers)
        if parts == ["execute"] and method == "POST":
            return await self._execute(t, await json_body(request, MAX_JSON))
        if parts == ["contexts"] and method == "POST":
            body = await json_body(request, MAX_JSON)
            language = _optional_str(body, "language") or "python"
            cwd = e2b_path(_optional_str(body, "cwd") or HOME)
            context = await t.front.handle(ops.CreateContext(t.sandbox_id, language=language, cwd=cwd))
            return Response(
                json.dumps({"id": context, "language": language, "cwd": cwd}), media_type="application/json"
            )
        if parts == ["contexts"] and method == "GET":
            contexts = await t.front.handle(ops.ListContexts(t.sandbox_id))
            return Response(
                json.dumps([{"id": c.id, "language": c.language, "cwd": c.cwd} for c in contexts]),
                media_type="application/json",
            )
        if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            await t.front.handle(ops.RemoveContext(t.sandbox_id, parts[1]))
            return Response(status_code=204)
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
            await t.front.handle(ops.RestartContext(t.sandbox_id, parts[1]))
            return Response(status_code=204)
        return error_response(404, f"the code interpreter has no route {method} {request.url.path}")

    async def _execute(self, t: Target, body: dict[str, Any]) -> Response:
        code = body.get("code")
        if not isinstance(code, str):
            raise InvalidArgument("code must be a string")
        context = _optional_str(body, "context_id")
        language = _optional_str(body, "language")
        if context and language:
            raise InvalidArgument("you can provide context_id or language, but not both")
        envs = body.get("env_vars")
        if envs is not None and not isinstance(envs, dict):
            raise InvalidArgument(f"env_vars must be an object of strings, got {type(envs).__name__}")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        run = ops.RunCode(
            t.sandbox_id,
            code,
            context=context or "default",
            language=None if context else language,
            timeout=None,  # the client's own timeout ends the request, and the run with it
            envs=envs or None,
            on_stdout=lambda s: queue.put_nowait({"type": "stdout", "text": s, "timestamp": _now()}),
            on_stderr=lambda s: queue.put_nowait({"type": "stderr", "text": s, "timestamp": _now()}),
        )
        task = asyncio.ensure_future(t.front.handle(run))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            first = await queue.get()
        except BaseException:
            task.cancel()
            raise
        failed = task.exception() if first is None else None
        if isinstance(failed, WarmboxError):
            raise failed  # before any byte: a plain error answer with its status

        async def lines() -> AsyncIterator[bytes]:
            # Output comes as the cell writes it (print's text and its newline are two writes);
            # like Jupyter's kernel, a stream's pieces are joined up to a line end or a short pause.
            pending: dict[str, Any] | None = None
            item = first
            try:
                while item is not None:
                    if pending is not None and pending["type"] == item["type"]:
                        pending["text"] += item["text"]
                    else:
                        if pending is not None:
                            yield _line(pending)
                        pending = item
                    if pending["text"].endswith("\n") or len(pending["text"]) > FLUSH_BYTES:
                        yield _line(pending)
                        pending = None
                    try:
                        item = await (queue.get() if pending is None else asyncio.wait_for(queue.get(), FLUSH_S))
                    except TimeoutError:
                        assert pending is not None
                        yield _line(pending)
                        pending = None
                        item = await queue.get()
                if pending is not None:
                    yield _line(pending)
                exc = task.exception()
                if exc is None:
                    for ev in end_events(task.result()):
                        yield _line(ev)
                elif isinstance(exc, WarmboxError):
                    yield _line({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""})
                    yield _line({"type": "unexpected_end_of_execution"})
                else:
                    raise exc
            finally:
                if not task.done():  # the client went away: stop the run in the sandbox
                    task.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson")


__all__ = ["Interpreter", "end_events", "result_event"]
