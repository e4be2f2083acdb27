"""E2B's names an E2B user reaches for (issue 34, item 12): ``Sandbox.kill(sandbox_id)`` on the
class as well as on a sandbox, sync and async, in process and over a server; ``request_timeout=``."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import over_http
from warmbox import AsyncSandbox, InvalidArgument, Sandbox
from warmbox.errors import ConnectionLost

pytestmark = pytest.mark.sandbox


def _remote(server) -> dict:
    return {"api_url": server.client_env["WARMBOX_API_URL"], "api_key": server.client_env["WARMBOX_API_KEY"]}


def _ids(**where) -> set[str]:
    return {i.sandbox_id for i in Sandbox.list(**where)}


def test_kill_by_id_on_the_class_and_on_a_sandbox(home, runc_ready, api_server):
    # in process, blocking: what raised AttributeError: 'str' object has no attribute '_async'
    sb = Sandbox.create(timeout=120, pool=False, home=home)
    assert Sandbox.kill(sb.sandbox_id, home=home) is True
    assert sb.sandbox_id not in _ids(home=home)
    assert Sandbox.kill(sb.sandbox_id, home=home) is False  # E2B: False when there is none
    sb.close()
    # the instance method is unchanged
    sb = Sandbox.create(timeout=120, pool=False, home=home)
    assert sb.kill() is True and sb.sandbox_id not in _ids(home=home)

    async def main() -> None:
        a = await AsyncSandbox.create(timeout=120, pool=False, home=home)
        assert await AsyncSandbox.kill(a.sandbox_id, home=home) is True
        assert await AsyncSandbox.kill("sb-0000000000", home=home) is False
        await a.close()

    asyncio.run(main())
    # over a server, with E2B's request_timeout
    remote = _remote(api_server)
    sb = Sandbox.create(timeout=120, pool=False, request_timeout=300, **remote)
    assert Sandbox.kill(sb.sandbox_id, request_timeout=60, **remote) is True
    assert sb.sandbox_id not in _ids(**remote)
    assert Sandbox.kill(sb.sandbox_id, **remote) is False
    sb.close()
    with pytest.raises(InvalidArgument, match="sandbox id"):
        Sandbox.kill(None, home=home)  # type: ignore[arg-type]


def test_request_timeout_bounds_each_request_to_a_server(home, runc_ready, api_server):
    remote = _remote(api_server)
    with pytest.raises(InvalidArgument, match="request_timeout"):
        Sandbox.create(request_timeout=0, **remote)
    before = _ids(**remote)
    # a cold create takes far longer than 10 ms: the client stops waiting, typed
    with pytest.raises(ConnectionLost, match="did not answer create in time"):
        Sandbox.create(timeout=120, pool=False, request_timeout=0.01, **remote)
    # the server finished it all the same: nothing is left behind by the test
    for _ in range(100):
        left = _ids(**remote) - before
        if left:
            break
        time.sleep(0.2)
    for sid in left:
        assert Sandbox.kill(sid, **remote) is True


def test_signed_file_urls_sync_and_async(request, home, runc_ready, api_server):
    """files.upload_url / download_url (also on the sandbox, as E2B names them; one operation,
    files.sign_url): the URL alone writes and reads the one file it names. In process its address
    is the home's [server] one (here the session's server on the same home serves it); over HTTP
    the server's, and through a cluster's router, which checks what the sandbox's node signed."""
    base = None if over_http(request.node) else api_server.url
    sb = Sandbox.create(timeout=120)
    try:
        up = sb.files.upload_url("signed/up.txt", expires_in=60, base_url=base)
        with urllib.request.urlopen(urllib.request.Request(up, data=b"via url", method="PUT"), timeout=60) as r:
            assert json.loads(r.read())["path"] == "/workspace/signed/up.txt"
        assert sb.files.read("signed/up.txt") == "via url"
        with pytest.raises(InvalidArgument, match="expires_in"):
            sb.files.download_url("signed/up.txt", expires_in=0, base_url=base)

        async def signed() -> str:
            a = await AsyncSandbox.connect(sb.sandbox_id)
            try:
                return await a.download_url("/workspace/signed/up.txt", base_url=base)  # E2B's name on the sandbox
            finally:
                await a.close()

        down = asyncio.run(signed())
        with urllib.request.urlopen(down, timeout=60) as r:
            assert r.read() == b"via url"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(down.replace("up.txt", "other.txt"), timeout=60)
        assert e.value.code == 401
    finally:
        sb.kill()
