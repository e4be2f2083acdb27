"""Code-context kernel: one long-lived Python interpreter whose globals survive between runs.

Started by the agent with a socketpair fd; receives ContextRun, answers with Stdout/Stderr/
Display frames and one CodeDone. SIGINT (sent on timeout) interrupts the running cell only.
"""

from __future__ import annotations

import ast
import builtins
import io
import signal
import socket
import sys
import threading
import time
import traceback

from warmbox import protocol as p

_RICH = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)


class _Out(io.TextIOBase):
    """sys.stdout/sys.stderr replacement that streams every write as a frame."""

    def __init__(self, run: _Run, kind: type) -> None:
        self._run = run
        self._kind = kind

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self._run.emit(self._kind, s.encode("utf-8", "replace"))
        return len(s)

    def flush(self) -> None:
        pass

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class _Run:
    def __init__(self, sock: socket.socket, msg: p.ContextRun) -> None:
        self.sock = sock
        self.msg = msg
        self.sent = 0
        self.truncated = False
        self.results = 0
        self.lock = threading.Lock()

    def emit(self, kind: type, data: bytes) -> None:
        with self.lock:
            room = self.msg.max_output - self.sent
            if len(data) > room:
                self.truncated = True
                data = data[: max(room, 0)]
            if not data:
                return
            self.sent += len(data)
            for off in range(0, len(data), p.CHUNK):
                self.send(kind(id=self.msg.id, data=data[off : off + p.CHUNK]))

    def send(self, msg: p.Message) -> None:
        self.sock.sendall(p.encode(msg))

    def display(self, value: object, main: bool) -> None:
        index = self.results
        self.results += 1
        for attr, mime in _RICH:
            method = getattr(type(value), attr, None)
            if method is None:
                continue
            try:
                out = method(value)
            except Exception:
                continue
            if out is None:
                continue
            if isinstance(out, tuple):  # (data, metadata) form
                out = out[0]
            data = out if isinstance(out, bytes) else str(out).encode()
            if len(data) <= p.MAX_BODY:
                self.send(p.Display(id=self.msg.id, mime=mime, data=data, main=main, result=index))
        try:
            text = repr(value)
        except Exception as e:
            text = f"<unrepresentable {type(value).__name__}: {e}>"
        self.send(
            p.Display(id=self.msg.id, mime="text/plain", data=text.encode()[: p.MAX_BODY], main=main, result=index)
        )


def _bounded(text: str, limit: int = 64 << 10) -> str:
    """What an error report may carry: at most ``limit`` chars, valid UTF-8."""
    if len(text) > limit:
        text = text[:limit] + "... [truncated]"
    return text.encode("utf-8", "replace").decode("utf-8")


def _split(code: str, name: str) -> tuple[ast.Module, ast.Expression | None]:
    tree = ast.parse(code, name, "exec")
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop()
        assert isinstance(last, ast.Expr)
        return tree, ast.Expression(body=last.value)
    return tree, None


def _reseed(seed: bytes) -> None:
    """New states for the generators a memory snapshot copied into every restored sandbox: the
    ``random`` module's and NumPy's legacy global one (only those already imported)."""
    rnd = sys.modules.get("random")
    if rnd is not None:
        try:
            rnd.seed(seed)
        except Exception:  # a user's own replacement of the module: leave it
            pass
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            import hashlib  # OpenSSL: loaded only where NumPy is (an import costs ~0.1 s under TCG)

            words = hashlib.sha512(seed).digest()
            np_random.seed([int.from_bytes(words[i : i + 4], "little") for i in range(0, 64, 4)])
        except Exception:
            pass


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    # SIGINT may arrive ignored from the spawner; a timeout relies on it raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    count = 0
    real_out, real_err = sys.stdout, sys.stderr
    while True:
        try:
            msg = p.recv_message(sock, (p.ContextRun, p.Configure, p.Reseed))
        except KeyboardInterrupt:  # a late interrupt between cells
            continue
        except (OSError, p.ProtocolViolation):
            return
        if msg is None:
            return
        if isinstance(msg, p.Reseed):
            _reseed(msg.seed)
            try:
                sock.sendall(p.encode(p.Ok(id=msg.id)))
            except OSError:
                return
            continue
        if isinstance(msg, p.Configure):
            import os

            os.environ.update(msg.env)
            if msg.reset_counts:
                count = 0
            try:
                sock.sendall(p.encode(p.Ok(id=msg.id)))
            except OSError:
                return
            continue
        if not isinstance(msg, p.ContextRun):  # recv_message allows only the three kinds above
            return
        count += 1
        run = _Run(sock, msg)
        start = time.monotonic()
        err_name = err_value = tb = ""
        namespace["display"] = lambda obj, run=run: run.display(obj, main=False)
        sys.stdout, sys.stderr = _Out(run, p.Stdout), _Out(run, p.Stderr)
        try:
            try:
                body, last = _split(msg.code, f"<cell {count}>")
                exec(compile(body, f"<cell {count}>", "exec"), namespace)
                if last is not None:
                    value = eval(compile(last, f"<cell {count}>", "eval"), namespace)
                    if value is not None:
                        namespace["_"] = value
                        run.display(value, main=True)
            except BaseException as e:  # the user's error, reported, never fatal to the kernel
                err_name, err_value = type(e).__name__, str(e)
                frames = traceback.extract_tb(e.__traceback__)
                # drop this module's own frames; keep the user's cells
                keep = [f for f in frames if f.filename != __file__]
                tb = "".join(traceback.format_list(keep)) + "".join(traceback.format_exception_only(type(e), e))
        finally:
            sys.stdout, sys.stderr = real_out, real_err
        err_value, tb = _bounded(err_value), _bounded(tb)
        try:
            run.send(
                p.CodeDone(
                    id=msg.id,
                    error_name=err_name,
                    error_value=err_value,
                    traceback=tb,
                    timed_out=False,
                    truncated=run.truncated,
                    execution_count=count,
                    duration_ms=(time.monotonic() - start) * 1e3,
                    oom_kills=-1,
                )
            )
        except KeyboardInterrupt:  # pragma: no cover - interrupt landed while reporting
            pass
        except OSError:
            return
