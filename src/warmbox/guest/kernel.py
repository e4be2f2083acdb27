"""Code-context kernel: one long-lived Python interpreter whose globals survive between runs.

Started by the agent with a socketpair fd; receives ContextRun, answers with Stdout/Stderr/
Display frames and one CodeDone. SIGINT (sent on timeout) interrupts the running cell only.
"""

from __future__ import annotations

# C modules, not ast, signal, socket (enum, contextlib, selectors) and traceback (on an error
# only): an idle context's memory is its imports, and a context forked from the agent (which
# imported these already) shares them with it
import _ast
import _signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import _socket
import builtins
import io
import os
import sys
import threading
import time

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
    def __init__(self, sock: _socket.socket, msg: p.ContextRun) -> None:
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


def _split(code: str, name: str) -> tuple[_ast.Module, _ast.Expression | None]:
    tree = compile(code, name, "exec", _ast.PyCF_ONLY_AST)  # ast.parse without the ast module
    assert isinstance(tree, _ast.Module)
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = tree.body.pop()
        assert isinstance(last, _ast.Expr)
        return tree, _ast.Expression(body=last.value)
    return tree, None


def _traceback(e: BaseException) -> str:
    """The user's part of ``e``'s traceback (this module's frames dropped), as Python prints it."""
    try:
        import traceback  # only once a cell failed: an idle context never pays for it

        frames = traceback.extract_tb(e.__traceback__)
        keep = [f for f in frames if f.filename != __file__]
        return "".join(traceback.format_list(keep)) + "".join(traceback.format_exception_only(type(e), e))
    except BaseException:  # an interrupt (or no memory) while formatting: the error's line alone
        return f"{type(e).__name__}: {e}\n"


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


_REQUESTS = (p.ContextRun, p.ContextRunEnv, p.Configure, p.Reseed)


def _set_env(env: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """Set a run's own variables; what each was before, and what the run got."""
    before = {k: (os.environ.get(k), v) for k, v in env.items()}
    os.environ.update(env)
    return before


def _restore_env(before: dict[str, tuple[str | None, str]]) -> None:
    """After the run: each variable back as it was, unless the cell itself changed it."""
    for k, (old, given) in before.items():
        if os.environ.get(k) != given:
            continue
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old


def main(fd: int) -> None:
    sock = _socket.socket(fileno=fd)
    # SIGINT may arrive ignored from the spawner; a timeout relies on it raising KeyboardInterrupt.
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    _seed_font_cache()
    if "matplotlib" not in sys.modules:
        sys.meta_path.insert(0, _MatplotlibHook())
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    count = 0
    real_out, real_err = sys.stdout, sys.stderr
    while True:
        try:
            msg = p.recv_message(sock, _REQUESTS)
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
        if not isinstance(msg, p.ContextRun):  # recv_message allows only the kinds above
            return
        count += 1
        own = _set_env(msg.env) if isinstance(msg, p.ContextRunEnv) else {}
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
                tb = _traceback(e)
            _end_of_cell(run)
        finally:
            _running.clear()
            sys.stdout, sys.stderr = real_out, real_err
            _restore_env(own)
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


# The PYTHON* variables a context forked from the agent honours as a fresh interpreter would (or
# that change nothing for one); any other variable Python reads makes the agent exec the kernel
# (agent.fork_eligible): the agent's interpreter started under -I, and a hash seed, a warnings
# filter or a PYTHONPATH cannot be applied after start.
FORK_ENV_OK = frozenset(
    {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONIOENCODING"}
)
# names of other programs' (official Docker images set these): Python reads none of them
FORK_ENV_FOREIGN = frozenset(
    {
        "PYTHON_VERSION",
        "PYTHON_SHA256",
        "PYTHON_PIP_VERSION",
        "PYTHON_SETUPTOOLS_VERSION",
        "PYTHON_GET_PIP_URL",
        "PYTHON_GET_PIP_SHA256",
    }
)


def _base_executable(python: str) -> str:
    """sys._base_executable of ``python`` started: a venv's (pyvenv.cfg next to it or one level up)
    names it, or its ``home`` holds one of the same name; else the interpreter itself."""
    here = os.path.dirname(os.path.abspath(python))
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        try:
            with open(cfg, encoding="utf-8") as f:
                keys = dict(line.split("=", 1) for line in f.read(64 << 10).splitlines() if "=" in line)
        except (OSError, ValueError):
            continue
        keys = {k.strip().lower(): v.strip() for k, v in keys.items()}
        if keys.get("executable"):
            return keys["executable"]
        if keys.get("home"):
            return os.path.join(keys["home"], os.path.basename(python))
    return python


def from_fork(fd: int, python: str, agent_lib: str) -> None:
    """Run as a context in a process forked from the guest agent, made first what ``python -u -c``
    (the sandbox's venv interpreter, the agent's binary) would be: its ``sys.executable``, flags,
    path and ``site`` (the venv's and the user's site-packages, .pth files, sitecustomize), with
    the agent's copy of warmbox off the path. The agent already dropped its descriptors, signal
    handlers and cgroup, and set the environment and directory (scopes.py ``_forked``)."""
    env = os.environ
    sys.executable = python
    sys._base_executable = _base_executable(python)  # type: ignore[attr-defined]  # (no stub)
    sys.argv[:] = ["-c"]
    sys.orig_argv[:] = [python, "-u", "-c", "<warmbox code context>"]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    user_site = not env.get("PYTHONNOUSERSITE")
    # the agent's -I -S: none of it applies to this interpreter (what reads sys.flags, e.g. the
    # interpreter flags multiprocessing's spawn passes on, must see those of ``python -u``)
    fields = type(sys.flags).__match_args__  # type: ignore[attr-defined]  # a structseq's names
    values = {f: getattr(sys.flags, f) for f in fields}
    values.update(isolated=0, no_site=0, ignore_environment=0, no_user_site=int(not user_site))
    values["dont_write_bytecode"] = int(sys.dont_write_bytecode)
    if "safe_path" in values:
        values["safe_path"] = False
    import collections

    sys.flags = collections.namedtuple("flags", fields)(**values)  # type: ignore[assignment,misc]
    sys.path[:] = [d for d in sys.path if d != agent_lib]
    if "site" in sys.modules:
        sys.modules["site"].main()
    else:  # its import runs site.main() now that sys.flags says -S was not given, as at a start
        import site  # noqa: F401
    sys.path.insert(0, "")  # -c: the working directory, put first after site ran (as at a start)
    main(fd)
