"""What every part of the guest agent shares: the request inbox, typed failures and errno codes."""

from __future__ import annotations

import collections
import errno
import threading

from warmbox import protocol as p

_ERRNO = {
    errno.ENOENT: p.ErrorCode.NOT_FOUND,
    errno.EEXIST: p.ErrorCode.EXISTS,
    errno.EISDIR: p.ErrorCode.IS_A_DIRECTORY,
    errno.ENOTDIR: p.ErrorCode.NOT_A_DIRECTORY,
    errno.EACCES: p.ErrorCode.PERMISSION_DENIED,
    errno.EPERM: p.ErrorCode.PERMISSION_DENIED,
    errno.EROFS: p.ErrorCode.PERMISSION_DENIED,
    errno.ENOSPC: p.ErrorCode.NO_SPACE,
    errno.EDQUOT: p.ErrorCode.NO_SPACE,
    errno.EFBIG: p.ErrorCode.NO_SPACE,
    errno.ENOTEMPTY: p.ErrorCode.EXISTS,
}


class Inbox:
    """Unbounded FIFO for follow-up frames of one request (queue.Queue without its imports)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def get(self) -> object:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    EMPTY = object()

    def poll(self) -> object:
        """The next item without waiting, or ``Inbox.EMPTY``."""
        with self._cond:
            return self._items.popleft() if self._items else Inbox.EMPTY


class _Fail(Exception):
    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _oserror(e: OSError) -> _Fail:
    code = _ERRNO.get(e.errno or 0, p.ErrorCode.INTERNAL)
    return _Fail(code, f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
