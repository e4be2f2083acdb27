"""Code-context kernel: one long-lived Python interpreter whose globals survive between runs.

Started by the agent with a socketpair fd; receives ContextRun, answers with Stdout/Stderr/
Display frames and one CodeDone. SIGINT (sent on timeout) interrupts the running cell only.
"""

from __future__ import annotations

import ast
import builtins
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback

from warmbox import protocol as p

TYPE_CHECKING = False  # typing is not imported at runtime: each context's start pays for imports
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

_RICH = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_pdf_", "application/pdf"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
_MIMES = frozenset(m for _, m in _RICH) | {"text/plain"}
_BINARY = frozenset({"image/png", "image/jpeg", "application/pdf"})  # raw bytes on the wire
_INLINE = "module://warmbox.guest.mpl_inline"
_FONT_SEED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "matplotlib")


def _mime_data(mime: str, out: object) -> bytes | None:
    """One representation as wire bytes: images raw (a base64 string is decoded), JSON as JSON
    text, the rest as UTF-8; None when it cannot be one."""
    if isinstance(out, tuple) and out:  # (data, metadata) form
        out = out[0]
    if out is None:
        return None
    if mime in _BINARY:
        if isinstance(out, str):
            import base64
            import binascii

            try:
                return base64.b64decode(out, validate=False)
            except (binascii.Error, ValueError):
                return None
        return bytes(out) if isinstance(out, (bytes, bytearray, memoryview)) else None
    if mime == "application/json" and not isinstance(out, (str, bytes)):
        import json

        try:
            return json.dumps(out).encode()
        except (TypeError, ValueError, RecursionError):
            return None
    if isinstance(out, bytes):
        return out
    return str(out).encode("utf-8", "replace")


def _figure_png(fig: object) -> bytes | None:
    """A matplotlib figure as PNG (as Jupyter's inline backend draws it), or None if not one."""
    figure_mod = sys.modules.get("matplotlib.figure")
    if figure_mod is None or not isinstance(fig, figure_mod.Figure):
        return None
    buf = io.BytesIO()
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _bundle(value: object) -> dict[str, bytes]:
    """Every representation ``value`` offers: _repr_mimebundle_, then the _repr_*_ methods, a
    matplotlib figure's PNG, and repr() as text/plain. A failing method is skipped."""
    bundle: dict[str, bytes] = {}
    method = getattr(type(value), "_repr_mimebundle_", None)
    if method is not None:
        try:
            out = method(value)
            if isinstance(out, tuple) and out:
                out = out[0]
            if isinstance(out, dict):
                for mime, data in out.items():
                    if mime in _MIMES:
                        raw = _mime_data(mime, data)
                        if raw is not None:
                            bundle[mime] = raw
        except Exception:
            pass
    for attr, mime in _RICH:
        if mime in bundle:
            continue
        method = getattr(type(value), attr, None)
        if method is None:
            continue
        try:
            raw = _mime_data(mime, method(value))
        except Exception:
            continue
        if raw is not None:
            bundle[mime] = raw
    if "image/png" not in bundle:
        try:
            png = _figure_png(value)
        except Exception:
            png = None
        if png is not None:
            bundle["image/png"] = png
    if "text/plain" not in bundle:
        try:
            text = repr(value)
        except Exception as e:
            text = f"<unrepresentable {type(value).__name__}: {e}>"
        bundle["text/plain"] = text.encode("utf-8", "replace")
    return bundle


class _MatplotlibHook:
    """Import hook (one shot): when a cell first imports matplotlib, select the inline backend
    unless the user chose one (MPLBACKEND); figures then become results."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != "matplotlib":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _InlineLoader(spec.loader)  # type: ignore[assignment]
        return spec


class _InlineLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module keeps its real loader (importlib.resources and the like ask it)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if not os.environ.get("MPLBACKEND"):
            try:
                module.rcParams["backend"] = _INLINE
            except Exception:  # an unexpected matplotlib: it keeps its own backend
                pass


def _seed_font_cache() -> None:
    """Copy the image's prebuilt matplotlib font list into the user's cache directory (matplotlib
    would spend 0.3-0.6 s, much more under TCG, scanning fonts on its first import)."""
    try:
        names = [n for n in os.listdir(_FONT_SEED) if n.startswith("fontlist-") and n.endswith(".json")]
    except OSError:
        return
    target = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "matplotlib"
    )
    for name in names:
        dst = os.path.join(target, name)
        if os.path.exists(dst):
            continue
        try:
            os.makedirs(target, exist_ok=True)
            with open(os.path.join(_FONT_SEED, name), "rb") as src:
                data = src.read(16 << 20)
            tmp = f"{dst}.{os.getpid()}.tmp"
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, dst)
        except OSError:
            return


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
        self.shown: list[object] = []  # the figures already results of this cell
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
        figure_mod = sys.modules.get("matplotlib.figure")
        if figure_mod is not None and isinstance(value, figure_mod.Figure):
            self.shown.append(value)
        self.send_bundle(_bundle(value), main)

    def send_bundle(self, bundle: dict[str, bytes], main: bool) -> None:
        index = self.results
        self.results += 1
        for mime, data in bundle.items():
            if mime != "text/plain" and len(data) <= p.MAX_BODY:
                self.send(p.Display(id=self.msg.id, mime=mime, data=data, main=main, result=index))
        # text/plain last: it tells the host the result is complete
        text = bundle.get("text/plain", b"")[: p.MAX_BODY]
        self.send(p.Display(id=self.msg.id, mime="text/plain", data=text, main=main, result=index))

    def show_figures(self) -> None:
        """Every open pyplot figure not shown yet in this cell as a result; then all are closed."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            figures = [m.canvas.figure for m in pyplot._pylab_helpers.Gcf.get_all_fig_managers()]
        except Exception:
            return
        for fig in figures:
            if not any(fig is f for f in self.shown):
                self.display(fig, main=False)
        pyplot.close("all")


def _end_of_cell(run: _Run) -> None:
    """Figures the cell drew and did not show become results (inline backend only), as in Jupyter."""
    mpl = sys.modules.get("matplotlib")
    if mpl is None or "matplotlib.pyplot" not in sys.modules:
        return
    try:
        if dict.__getitem__(mpl.rcParams, "backend") != _INLINE:
            return
        run.show_figures()
    except BaseException as e:  # drawing failed (or an interrupt): said on stderr, the cell's outcome stands
        try:
            sys.stderr.write(f"warmbox: could not render the cell's figures: {type(e).__name__}: {e}\n")
        except Exception:
            pass


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


_running: list[_Run] = []  # the cell running now (at most one): where plt.show() puts its figures


def show_figures() -> None:
    """Every open pyplot figure as a result of the running cell (the inline backend's show())."""
    if _running:
        _running[0].show_figures()


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    # SIGINT may arrive ignored from the spawner; a timeout relies on it raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _seed_font_cache()
    if "matplotlib" not in sys.modules:
        sys.meta_path.insert(0, _MatplotlibHook())
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
        _running.append(run)
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
            _end_of_cell(run)
        finally:
            _running.clear()
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
