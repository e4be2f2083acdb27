"""The HTTP API's contract without a server: routes cover the one list, the codec is strict and
round-trips every result type, every error class travels as its code, and the committed OpenAPI
document is the generated one."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from warmbox import api, errors, wire
from warmbox import operations as ops
from warmbox.models import (
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    Limits,
    Result,
    SandboxInfo,
    StageTiming,
    State,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_operation_has_exactly_one_route():
    assert sorted(r.op.value for r in api.ROUTES) == sorted(op.value for op in ops.REQUESTS)
    assert len({(r.method, r.path) for r in api.ROUTES}) == len(api.ROUTES)
    for r in api.ROUTES:
        fields = {f.name for f in dataclasses.fields(ops.REQUESTS[r.op])}
        assert set(r.path_fields) <= fields, r
        assert r.path.startswith(api.PREFIX + "/")
        if r.method in ("GET", "DELETE"):
            assert r.body == "query", r  # no bodies on GET/DELETE


def test_each_route_kind_has_one_answer_on_the_server_and_one_reader_in_the_sdk():
    from warmbox.sdk import http
    from warmbox.server import app

    kinds = set(typing.get_args(api.Kind))
    assert set(api.KINDS) == kinds and set(app.ANSWERS) == kinds and set(http._READERS) == kinds
    assert {r.kind for r in api.ROUTES} == kinds  # no kind declared that no route has
    assert all(r.body == "raw" for r in api.ROUTES if r.streamed)


def test_a_network_policy_is_decoded_by_the_codec():
    from warmbox.apicodec import build
    from warmbox.network.policy import Network

    create = wire.decode_record(ops.Create, {"network": {"allow": ["pypi.org"], "on_unknown": "ask"}})
    assert create.network == Network(allow=("pypi.org",), on_unknown="ask")
    assert wire.decode_record(ops.UpdateNetwork, {"network": "internet"}, sandbox_id="sb-1").network == "internet"
    with pytest.raises(errors.InvalidArgument, match="network has the wrong type"):
        wire.decode_record(ops.Create, {"network": 5})
    with pytest.raises(errors.InvalidArgument, match="not a host"):  # the policy's own error, not "wrong type"
        wire.decode_record(ops.Create, {"network": {"allow": ["not a host!"]}})
    assert json.loads(build(ops.Create(network=Network(allow=["pypi.org"])))[1]["data"])["network"]["allow"] == [
        "pypi.org"
    ]
    assert json.loads(build(ops.Create(network="none"))[1]["data"])["network"] == "none"
    with pytest.raises(errors.InvalidArgument, match=r"must be a warmbox\.Network"):  # as in process
        build(ops.Create(network={"allow": ["pypi.org"]}))  # type: ignore[arg-type]


def test_route_urls_quote_ids():
    r = api.BY_OP[ops.Op.INFO]
    assert r.url(ops.Info("a/../b c")) == "/v1/sandboxes/a%2F..%2Fb%20c"


def test_results_round_trip():
    info = SandboxInfo("sb-1", "container", State.RUNNING, 1.0, 2.0, 512, 1.0, 256, "base")
    samples = [
        (ops.Opened, ops.Opened(info, (StageTiming("sb-1", "allocation", 0.5),))),
        (
            Execution,
            Execution(
                (Result(True, text="4", png="iVBORwD/"),),
                "4\n",
                "",
                ExecutionError("E", "v", "tb"),
                False,
                False,
                False,
                3,
                1.5,
            ),
        ),
        (CommandResult, CommandResult(0, "hi\n", "", False, False, False, 0, 1.0, 7)),
        (list[EntryInfo], [EntryInfo("a", "/workspace/a", "file", 3, 0o644, 1.0, None)]),
        (list[tuple[str, str, float, int]], [("snap-1", "sb-1", 1.0, 10)]),
        (ops.GcReport, ops.GcReport(2, ("x",), "local")),
    ]
    for tp, value in samples:
        data = json.loads(json.dumps(wire.encode(value)))
        assert wire.decode(tp, data) == value
    # images travel as base64 strings, as E2B's results do
    assert wire.encode(Result(True, png="iVBORw=="))["png"] == "iVBORw=="


def test_requests_round_trip_with_tagged_bytes():
    r = ops.Exec("sb-1", ["python3", "-c", "0"], envs={"A": "1"}, stdin=b"\xff\x00", timeout=None)
    data = json.loads(json.dumps(wire.encode(r, tag_bytes=True)))
    assert data["stdin"] == {"base64": "/wA="}
    assert wire.decode_record(ops.Exec, data) == r
    assert wire.decode_record(ops.Exec, {**data, "stdin": "text"}).stdin == "text"
    c = ops.Create(tier="gvisor", limits=Limits(memory_mb=256))
    assert wire.decode_record(ops.Create, wire.encode(c)) == c


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"cmd": "true", "bogus": 1}, "unknown field 'bogus'"),
        ({}, "cmd is required"),
        ({"cmd": 5}, "wrong type"),
        ({"cmd": "true", "timeout": "60"}, "timeout"),
        ({"cmd": "true", "max_output": True}, "max_output must be an integer"),
        ({"cmd": "true", "envs": {"A": 1}}, "envs['A'] must be a string"),
        ({"cmd": "true", "on_stdout": "x"}, "unknown field 'on_stdout'"),  # callbacks are not data
        ({"cmd": "true", "sandbox_id": "sb-2"}, "unknown field 'sandbox_id'"),  # the path names it
    ],
)
def test_decode_is_strict(body, message):
    with pytest.raises(errors.InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        wire.decode_record(ops.Exec, body, "body", sandbox_id="sb-1")


def test_decode_refuses_deep_nesting_and_bad_base64():
    deep: object = "x"
    for _ in range(20):
        deep = [deep]
    with pytest.raises(errors.InvalidArgument):
        wire.decode(list[str], deep)
    with pytest.raises(errors.InvalidArgument, match="base64"):
        wire.decode(bytes, "%%%")


def test_every_error_class_travels_as_its_code():
    assert len(wire.ERRORS) >= 30
    for code, cls in wire.ERRORS.items():
        exc = cls.__new__(cls)
        Exception.__init__(exc, f"message of {code}")
        if isinstance(exc, errors.SandboxError):
            exc.sandbox_id = "sb-1"
        back = wire.error_from_wire(json.loads(json.dumps(wire.error_to_wire(exc))))
        assert type(back) is cls and str(back) == f"message of {code}"
        if isinstance(exc, errors.SandboxError):
            assert back.sandbox_id == "sb-1"
    lim = errors.LimitTooHigh("too much", limit="memory_mb", value=9e9, maximum=1024, source="host")
    back = wire.error_from_wire(wire.error_to_wire(lim))
    assert isinstance(back, errors.InvalidArgument) and back.limit == "memory_mb" and back.maximum == 1024
    assert isinstance(wire.error_from_wire({"code": "from_the_future", "message": "m"}), errors.WarmboxError)
    assert isinstance(wire.error_from_wire("garbage"), errors.WarmboxError)


def test_openapi_document_is_committed_and_valid():
    from openapi_spec_validator import validate

    from warmbox.server.openapi import document

    doc = document()
    validate(doc)
    committed = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert committed == json.loads(json.dumps(doc)), (
        "docs/openapi.json is stale: python -m warmbox.server.openapi > docs/openapi.json"
    )
    ops_in_doc = {m["operationId"] for p in doc["paths"].values() for m in p.values()}
    assert ops_in_doc == {op.value for op in ops.REQUESTS}


def test_only_an_argv_may_spell_non_utf8_bytes():
    """An argv's strings may carry surrogate-escaped bytes (os.fsdecode's U+DC80..U+DCFF): they
    reach the sandbox as those bytes. Anywhere else, and any other lone surrogate, is refused."""
    ops.check_text(ops.Exec("sb-1", ["printf", "%s", "caf\udce9"]))
    for bad in (
        ops.Exec("sb-1", ["printf", "\ud800"]),  # no byte is spelled so
        ops.Exec("sb-1", "printf caf\udce9"),  # a bash string is text
        ops.Exec("sb-1", ["true"], envs={"K": "caf\udce9"}),
    ):
        with pytest.raises(errors.InvalidArgument, match="lone surrogate"):
            ops.check_text(bad)
