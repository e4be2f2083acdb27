import inspect
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from warmbox import protocol as p


def roundtrip(msg, allowed):
    raw = p.encode(msg)
    hlen, _blen = p.split_prefix(raw[:8])
    return p.decode(raw[8 : 8 + hlen], raw[8 + hlen :], allowed)


def frame(header: dict, body: bytes = b""):
    raw = json.dumps(header).encode()
    return raw, body


def test_roundtrip_every_message_kind():
    msgs = [
        p.Exec(1, argv=["a", "b"], env={"K": "V"}, cwd="/w", timeout_s=1.5, max_output=10, stdin=True),
        p.Chunk(2, data=b"\x00\xff" * 100),
        p.Entry(3, name="a", path="/a", kind=p.FileType.DIR, size=0, mode=0o755, mtime=1.0, target=""),
        p.Failure(4, code=p.ErrorCode.NOT_FOUND, message="nope"),
        p.CodeDone(
            5,
            error_name="",
            error_value="",
            traceback="",
            timed_out=False,
            truncated=False,
            execution_count=1,
            duration_ms=0.5,
            oom_kills=-1,
        ),
        p.Exited(6, exit_code=137, signal=9, timed_out=False, truncated=False, duration_ms=3.0, oom_kills=2),
        p.Reseed(7, seed=b"\x01" * 32),
    ]
    for m in msgs:
        allowed = p.HOST_TO_GUEST if type(m) in p.HOST_TO_GUEST else p.GUEST_TO_HOST
        assert roundtrip(m, allowed) == m


def test_direction_is_enforced():
    # a guest may not send host->guest requests (e.g. an Exec) to the host
    with pytest.raises(p.ProtocolViolation):
        roundtrip(p.Exec(1, argv=["x"], env={}, cwd="", timeout_s=0, max_output=1, stdin=False), p.GUEST_TO_HOST)


@pytest.mark.parametrize(
    "header,body,why",
    [
        ({"type": "Nope", "id": 1}, b"", "unexpected message type"),
        ({"type": "Pong", "id": 1, "version": 1}, b"", "missing"),
        ({"type": "Pong", "id": 1, "version": 1, "pid": 2, "extra": 0}, b"", "unknown fields"),
        ({"type": "Pong", "id": 1, "version": "1", "pid": 2}, b"", "must be int"),
        ({"type": "Pong", "id": -1, "version": 1, "pid": 2}, b"", "id must be"),
        ({"type": "Pong", "id": 1, "version": True, "pid": 2}, b"", "must be int"),
        ({"type": "Failure", "id": 1, "code": "rm -rf", "message": ""}, b"", "unknown value"),
        ({"type": "Ok", "id": 1}, b"body", "carries no body"),
        ({"type": "__class__", "id": 1}, b"", "unexpected message type"),
    ],
)
def test_hostile_frames_are_rejected(header, body, why):
    raw, body = frame(header, body)
    with pytest.raises(p.ProtocolViolation, match=why):
        p.decode(raw, body, p.GUEST_TO_HOST)


def test_garbage_and_oversize():
    with pytest.raises(p.ProtocolViolation):
        p.decode(b"\xff\xfe not json", b"", p.GUEST_TO_HOST)
    with pytest.raises(p.ProtocolViolation):
        p.decode(b"[1, 2]", b"", p.GUEST_TO_HOST)
    with pytest.raises(p.ProtocolViolation, match="too large"):
        p.split_prefix(struct.pack(">II", p.MAX_HEADER + 1, 0))
    with pytest.raises(p.ProtocolViolation, match="too large"):
        p.split_prefix(struct.pack(">II", 10, p.MAX_BODY + 1))
    with pytest.raises(p.ProtocolViolation, match="too large"):
        p.encode(p.Chunk(1, data=b"x" * (p.MAX_BODY + 1)))


MESSAGES = [c for c in vars(p).values() if isinstance(c, type) and issubclass(c, p.Message) and c is not p.Message]


def test_fields_are_derived_from_annotations():
    assert set(MESSAGES) == set(p.HOST_TO_GUEST) | set(p.GUEST_TO_HOST)  # each one has a direction
    for cls in MESSAGES:
        annotations = inspect.get_annotations(cls)
        parent = cls.__base__.FIELDS if cls.__base__ is not p.Message else ()  # a subclass adds fields
        assert cls.FIELDS == parent + tuple((n, "".join(a.split())) for n, a in annotations.items()), cls
        assert all(t in p.WIRE_TYPES for _, t in cls.FIELDS), cls
        bodies = [n for n, t in cls.FIELDS if t == "bytes"]
        assert cls._body == (bodies[0] if bodies else None), cls
        for annotation in annotations.values():  # a real type to a type checker, not just a table key
            hint = eval(annotation, vars(p))
            assert isinstance(getattr(hint, "__origin__", hint), type), (cls, annotation)
    assert p.Exec.FIELDS[:2] == (("argv", "list[str]"), ("env", "dict[str,str]"))
    assert p.Failure.FIELDS == (("code", "ErrorCode"), ("message", "str"))
    assert type(p.ErrorCode.NOT_FOUND) is p.ErrorCode and p.ErrorCode("not_found") is p.ErrorCode.NOT_FOUND


@pytest.mark.parametrize(
    "annotations,why",
    [
        ({"x": "set[int]"}, "not a wire type"),
        ({"x": "list[int]"}, "not a wire type"),
        ({"x": "str | None"}, "not a wire type"),
        ({"x": "Optional[str]"}, "not a wire type"),
        ({"x": "ProtocolViolation"}, "not a wire type"),
        ({"x": int}, "must be strings"),
        ({"a": "bytes", "b": "bytes"}, "more than one bytes field"),
        ({"type": "str"}, "reserved name"),
        ({"id": "int"}, "reserved name"),
        ({"FIELDS": "str"}, "reserved name"),
    ],
)
def test_unsupported_annotation_fails_at_class_creation(annotations, why):
    with pytest.raises(TypeError, match=why):
        type("Bad", (p.Message,), {"__annotations__": annotations})


def test_unsupported_annotation_in_class_statement():
    with pytest.raises(TypeError, match=r"Bad\.when"):

        class Bad(p.Message):
            when: "float | None"


def test_protocol_imports_in_bare_interpreter(tmp_path):
    # The guest imports protocol with -I -S on every cold start: stdlib only, and none of the
    # modules it avoids on purpose (typing, dataclasses).
    (tmp_path / "warmbox").mkdir()
    (tmp_path / "warmbox" / "__init__.py").write_text("")
    shutil.copy(p.__file__, tmp_path / "warmbox" / "protocol.py")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); before = set(sys.modules); "
        "import warmbox.protocol as p; print(sorted(set(sys.modules) - before)); print(p.Exec.FIELDS[0]); "
        # a malformed header is a ProtocolViolation there too (json's C scanner alone cannot say why)
        "exec('try:\\n p.decode(b\\'{bad}\\', b\\'\\', (p.Ping,))\\nexcept p.ProtocolViolation as e:\\n print(e)')"
    )
    bare = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run([bare, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    new, fields, violation = out.stdout.splitlines()
    assert violation == "header is not JSON"
    names = {m.split(".")[0] for m in eval(new)}
    assert names - sys.stdlib_module_names == {"warmbox"}
    # json imports re and enum (~0.6 MiB of every agent and kernel): its C accelerator is used alone
    assert not {"typing", "dataclasses", "json", "re", "enum"} & names
    assert fields == "('argv', 'list[str]')"


JSON_HEADERS = [
    b'{"a":1}',
    b' \t\r\n{"a" : [1, 2.5, -0.0, 1e400, -1e400, true, false, null, "x"]} \n',
    b'{"n":NaN,"i":Infinity,"m":-Infinity}',
    b'{"s":"\\ud800 lone","u":"\xc3\xa9\xe2\x82\xac","e":"\\u00e9\\n\\"\\\\"}',
    b'{"big":123456789012345678901234567890,"f":1.5e-300}',
    b'{"d":{"d":{"d":[[[[]]]]}}}',
    b'"just a string"',
    b"12",
    b"[1,]",
    b'{"a":1}x',
    b'{"a":1} {"b":2}',
    b"",
    b"   ",
    b"{",
    b'{"a":"\x01"}',  # a control character inside a string: strict
    b'{"a":01}',
    b"\xff\xfe{\x00}\x00",  # UTF-16 with a BOM: json reads it
    b"\xef\xbb\xbf{}",  # UTF-8 BOM
    b"{\x00}\x00",
    b"\x80{}",  # not UTF-8
    b'{"a":"\xed\xa0\x80"}',  # an encoded surrogate (json decodes with surrogatepass)
    b"[" * 100000 + b"]" * 100000,  # recursion
]


@pytest.mark.parametrize("raw", JSON_HEADERS, ids=range(len(JSON_HEADERS)))
def test_the_json_codec_is_json_exactly(raw):
    """protocol reads and writes headers with json's C accelerator alone: the same values and the
    same errors as json.loads / json.dumps(separators=(",", ":")) for every input."""
    import json

    def outcome(f):
        try:
            return "ok", f(raw)
        except (ValueError, RecursionError) as e:
            return type(e).__name__, str(e)

    want, got = outcome(json.loads), outcome(p._loads)
    assert repr(got) == repr(want)  # repr: NaN == NaN, and -0.0 apart from 0.0
    if want[0] == "ok":
        assert p._dumps(want[1]) == json.dumps(want[1], separators=(",", ":"))
    with pytest.raises(TypeError, match="not JSON serializable"):
        p._dumps({"a": object()})
    assert p._dumps({"k": p.ErrorCode.NOT_FOUND, "l": ["\ud800", "\u20ac"]}) == json.dumps(
        {"k": "not_found", "l": ["\ud800", "\u20ac"]}, separators=(",", ":")
    )


# ---- FrameReader / SocketReader: one buffer, every complete frame, bounds before the body


FRAMES = [
    p.Pong(1, version=4, pid=7),
    p.Stdout(2, data=b"out" * 1000),
    p.Ok(3),
    p.Exited(2, exit_code=0, signal=0, timed_out=False, truncated=False, duration_ms=1.0, oom_kills=-1),
]


def _drain(reader: p.FrameReader) -> list:
    out = []
    while (m := reader.next()) is not None:
        out.append(m)
    return out


@pytest.mark.parametrize("step", [1, 3, 8, 1000, 1 << 20])
def test_frame_reader_splits_a_stream_at_any_boundary(step):
    stream = b"".join(p.encode(m) for m in FRAMES)
    reader = p.FrameReader(p.GUEST_TO_HOST)
    got = []
    for off in range(0, len(stream), step):
        reader.feed(stream[off : off + step])
        got += _drain(reader)
    assert got == FRAMES and reader.pending() == 0
    assert all(type(m.data) is bytes for m in got if isinstance(m, p.Stdout))


def test_frame_reader_refuses_an_oversized_frame_at_its_prefix():
    reader = p.FrameReader(p.GUEST_TO_HOST)
    reader.feed(p.encode(FRAMES[0]) + struct.pack(">II", 10, p.MAX_BODY + 1))  # no body follows: none needed
    assert reader.next() == FRAMES[0]
    with pytest.raises(p.ProtocolViolation, match="too large"):
        reader.next()


def test_frame_reader_returns_the_frames_before_a_bad_one():
    reader = p.FrameReader(p.GUEST_TO_HOST)
    bad = json.dumps({"type": "Exec", "id": 1}).encode()  # a host->guest message from the guest
    reader.feed(p.encode(FRAMES[0]) + p.encode(FRAMES[2]) + struct.pack(">II", len(bad), 0) + bad)
    assert [reader.next(), reader.next()] == [FRAMES[0], FRAMES[2]]
    with pytest.raises(p.ProtocolViolation, match="unexpected message type"):
        reader.next()


def test_frame_reader_says_how_much_of_a_frame_is_missing():
    raw = p.encode(p.Stdout(1, data=bytes(5000)))
    reader = p.FrameReader(p.GUEST_TO_HOST)
    assert reader.missing() == p.PREFIX_SIZE
    reader.feed(raw[:3])
    assert reader.missing() == p.PREFIX_SIZE - 3 and reader.next() is None
    reader.feed(raw[3:100])
    assert reader.missing() == len(raw) - 100 and reader.pending() == 100
    reader.feed(raw[100:])
    assert reader.missing() == 0 and reader.next() == p.Stdout(1, data=bytes(5000))


class _Sock:
    """recv() from scripted pieces: bytes, or an exception to raise once."""

    def __init__(self, *pieces) -> None:
        self.pieces = list(pieces)
        self.asked: list[int] = []

    def recv(self, n: int) -> bytes:
        self.asked.append(n)
        if not self.pieces:
            return b""
        piece = self.pieces.pop(0)
        if isinstance(piece, Exception):
            raise piece
        assert len(piece) <= n
        return piece


def test_socket_reader_takes_every_frame_of_one_recv():
    stream = b"".join(p.encode(m) for m in FRAMES)
    sock = _Sock(stream)
    reader = p.SocketReader(sock, p.GUEST_TO_HOST)
    assert [reader.recv() for _ in FRAMES] == FRAMES
    assert reader.recv() is None  # clean EOF between frames
    assert len(sock.asked) == 2


def test_socket_reader_keeps_a_partial_frame_across_a_timeout_and_refuses_eof_mid_frame():
    raw = p.encode(FRAMES[1])
    reader = p.SocketReader(_Sock(raw[:10], TimeoutError("timed out"), raw[10:]), p.GUEST_TO_HOST)
    with pytest.raises(TimeoutError):
        reader.recv()
    assert reader.recv() == FRAMES[1]  # nothing was lost
    reader = p.SocketReader(_Sock(raw[:10]), p.GUEST_TO_HOST)
    with pytest.raises(p.ProtocolViolation, match="mid-frame"):
        reader.recv()


def test_socket_reader_reads_are_bounded_by_one_frame():
    big = p.encode(p.Chunk(1, data=bytes(p.MAX_BODY)))
    sock = _Sock(big[:100], big[100:])
    reader = p.SocketReader(sock, p.GUEST_TO_HOST, size=64 << 10)
    assert reader.recv() == p.Chunk(1, data=bytes(p.MAX_BODY))
    assert sock.asked == [64 << 10, len(big) - 100]  # the rest of the frame, not more
    assert max(sock.asked) <= p.MAX_FRAME


def test_decoded_messages_are_whole_and_construction_still_checks_fields():
    m = roundtrip(p.Failure(4, code=p.ErrorCode.NOT_FOUND, message="nope"), p.GUEST_TO_HOST)
    assert m.code is p.ErrorCode.NOT_FOUND and m.message == "nope" and m.id == 4
    assert repr(m) == "Failure(id=4, code=ErrorCode('not_found'), message='nope')"
    f = roundtrip(
        p.Exited(1, exit_code=0, signal=0, timed_out=False, truncated=False, duration_ms=1, oom_kills=0),
        p.GUEST_TO_HOST,
    )
    assert type(f.duration_ms) is float  # an int on the wire is a float field's value
    with pytest.raises(TypeError, match="expected fields"):
        p.Pong(1, version=4)
    with pytest.raises(TypeError, match="expected fields"):
        p.Pong(1, version=4, pid=1, extra=2)
    with pytest.raises(p.ProtocolViolation, match="unexpected message type"):
        p.decode(json.dumps({"type": ["Pong"], "id": 1}).encode(), b"", p.GUEST_TO_HOST)  # unhashable type
