"""Raw bodies from an operation's chunk stream, shared by warmbox's routes and the E2B dialect."""

from __future__ import annotations

from collections.abc import AsyncIterator

from warmbox.operations import ChunkStream


async def raw_body(stream: ChunkStream) -> AsyncIterator[bytes]:
    """``stream``'s chunks as a response body, its first chunk read before this returns: an error
    before the first byte is the caller's to answer as an error; one after it ends the body (the
    connection is cut without a closing chunk, so no client takes it as complete). The stream is
    cancelled when the body ends, however it ends."""
    try:
        first = await stream.next()
    except BaseException:
        stream.cancel()
        raise

    async def chunks() -> AsyncIterator[bytes]:
        try:
            chunk = first
            while chunk is not None:
                yield chunk
                chunk = await stream.next()
        finally:
            stream.cancel()

    return chunks()


__all__ = ["raw_body"]
