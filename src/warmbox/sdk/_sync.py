"""Derive the blocking API from the async one (the idea of Modal's synchronize_api).

``synchronize(AsyncX)`` builds class ``X`` whose coroutine methods block on a private event
loop running in one daemon thread per process. Return values that are instances of other
synchronized classes are wrapped, so ``Sandbox.create()`` returns a ``Sandbox`` whose
``commands`` is a ``Commands``. Callbacks passed in run on that loop's thread. An async
iterator (``__anext__``) becomes an iterator.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import threading
from typing import Any

_SYNC_OF: dict[type, type] = {}


class either:
    """A coroutine method callable on the class or on an instance, as E2B's ``Sandbox.kill``:
    ``AsyncSandbox.kill(sandbox_id)`` runs ``on_class(cls, ...)``, ``sb.kill()`` runs ``on_instance(sb, ...)``."""

    def __init__(self, on_instance: Any, on_class: Any) -> None:
        self.on_instance, self.on_class = on_instance, on_class
        self.__doc__ = on_instance.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return functools.partial(self.on_class, owner)
        return functools.partial(self.on_instance, obj)


def _either(owner: type, name: str, raw: either) -> either:
    """The blocking twin of an :class:`either` method of ``owner``."""

    @functools.wraps(raw.on_instance)
    def on_instance(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(_RUNNER.run(getattr(self._async, name)(*args, **kwargs)))

    @functools.wraps(raw.on_class)
    def on_class(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(_RUNNER.run(getattr(owner, name)(*args, **kwargs)))

    return either(on_instance, on_class)


class _LoopThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="warmbox-sync", daemon=True).start()
                self._loop = loop
                atexit.register(self._finish, loop)
            return self._loop

    @staticmethod
    def _finish(loop: asyncio.AbstractEventLoop) -> None:
        """At the process's exit: the loop's async generators finalized, as asyncio.run's end does
        (the HTTP transport's shared connections close there)."""
        try:
            asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop).result(5)
        except (RuntimeError, TimeoutError):
            pass  # the loop is stopped, or stuck in a caller's callback: the exit goes on

    def run(self, coro: Any) -> Any:
        loop = self.loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(
                "the sync warmbox API was called from its own event loop thread "
                "(inside a callback); use AsyncSandbox there"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


_RUNNER = _LoopThread()


def _wrap(value: Any) -> Any:
    cls = _SYNC_OF.get(type(value))
    if cls is not None:
        obj: Any = object.__new__(cls)
        obj._async = value
        return obj
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _method(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(_RUNNER.run(getattr(self._async, name)(*args, **kwargs)))

    return call


def _classmethod(owner: type, name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(_RUNNER.run(getattr(owner, name)(*args, **kwargs)))

    return classmethod(call)


def _next(self: Any) -> Any:
    try:
        return _wrap(_RUNNER.run(self._async.__anext__()))
    except StopAsyncIteration:
        raise StopIteration from None


def _property(name: str, prop: property) -> property:
    return property(lambda self: _wrap(getattr(self._async, name)), doc=prop.__doc__)


def _sub_api(attr: str, self: Any) -> Any:
    return _wrap(getattr(self._async, attr))


def synchronize(async_cls: type, name: str | None = None) -> type:
    """Build the blocking twin of ``async_cls``."""
    ns: dict[str, Any] = {"__doc__": async_cls.__doc__, "__module__": "warmbox", "__slots__": ("_async", "__weakref__")}
    for attr in dir(async_cls):
        if attr.startswith("_"):
            continue
        raw = inspect.getattr_static(async_cls, attr)
        if isinstance(raw, either):
            ns[attr] = _either(async_cls, attr, raw)
        elif isinstance(raw, classmethod) and inspect.iscoroutinefunction(raw.__func__):
            ns[attr] = _classmethod(async_cls, attr, raw.__func__)
        elif inspect.iscoroutinefunction(raw):
            ns[attr] = _method(attr, raw)
        elif isinstance(raw, property):
            ns[attr] = _property(attr, raw)
    # instance attributes holding sub-APIs (e.g. ``commands``) are exposed through properties
    for attr in getattr(async_cls, "_SYNC_ATTRS", ()):
        ns[attr] = property(functools.partial(_sub_api, attr))
    if hasattr(async_cls, "__anext__"):
        ns["__iter__"] = lambda self: self
        ns["__next__"] = _next
    if hasattr(async_cls, "__aenter__"):
        ns["__enter__"] = lambda self: self
        ns["__exit__"] = lambda self, *exc: _RUNNER.run(self._async.__aexit__(*exc))
    ns["__repr__"] = lambda self: repr(self._async).replace(async_cls.__name__, type(self).__name__, 1)
    sync_name = name or async_cls.__name__.removeprefix("Async")
    cls = type(sync_name, (), ns)
    _SYNC_OF[async_cls] = cls
    return cls
