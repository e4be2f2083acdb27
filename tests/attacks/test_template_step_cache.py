"""Attacks on the template build-step cache through a real `warmbox serve`, with two tenant keys.

- Tenant A builds a RUN step that writes bytes it generated, with a network allow list; tenant B
  builds the same step text with no network under another name. B's step used to come back
  ``cached`` with A's layer: B's sandboxes read A's bytes (or whatever A fetched through its allow
  list), and the ``cached`` event told B that A had run that step.
- The same tenant with another build network must run the step again too.
- A COPY of the same bytes may share its layer across tenants (both hold the bytes), but the
  other tenant's progress says ``done``, never ``cached``.
- A build network carrying secrets is refused, never quietly dropped.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import start_server
from warmbox import Network, Sandbox, Secret, Templates, wire
from warmbox import operations as ops
from warmbox.engine.engine import Engine
from warmbox.errors import InvalidArgument, TemplateNotFound
from warmbox.models import TemplateBuildEvent, TemplateInfo
from warmbox.templates import Template

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def tenants(home: Path, runc_ready: None):
    """A real server and two tenants' keys: (url, key of A, key of B)."""
    srv = start_server(home, home / "stepcache.sock")
    try:
        registry = Engine.for_home(home).registry
        tok = secrets.token_hex(3)
        _, a = registry.tenants.create_key(f"cache-a-{tok}")
        _, b = registry.tenants.create_key(f"cache-b-{tok}")
        yield srv.url, a, b
    finally:
        srv.stop()


def _build(url: str, key: str, name: str, t: Template) -> tuple[TemplateInfo, dict[int, set[str]]]:
    """Build over HTTP; the statuses each layer step reported."""
    events: list[TemplateBuildEvent] = []
    info = Templates.build(t, name, on_progress=events.append, api_url=url, api_key=key)
    steps: dict[int, set[str]] = {}
    for e in events:
        if e.step > 0 and e.status != "config":
            steps.setdefault(e.step, set()).add(e.status)
    return info, steps


def _read(url: str, key: str, template: str, path: str) -> str:
    with Sandbox.create(tier="container", template=template, pool=False, timeout=120, api_url=url, api_key=key) as sb:
        r = sb.commands.run(f"cat {path}")
        assert r.exit_code == 0, r.stderr
        return r.stdout


def _drop(url: str, key: str, *names: str) -> None:
    for n in names:
        try:
            Templates.delete(n, api_url=url, api_key=key)
        except TemplateNotFound:
            pass


def test_another_tenant_runs_the_same_step_itself_and_never_reads_its_output(tenants):
    url, a, b = tenants
    tok = secrets.token_hex(6)
    secret_file = f"/opt/wb-step-{tok}"
    step = f"head -c 24 /dev/urandom | base64 > {secret_file}"  # new bytes each time it really runs
    with_list = Template.from_template("base").run(step).network(["private.example"])
    without = Template.from_template("base").run(step)  # network "none"
    name_a, name_a2, name_b = f"sc-a-{tok}", f"sc-a2-{tok}", f"sc-b-{tok}"
    try:
        info_a, steps = _build(url, a, name_a, with_list)
        assert steps[1] == {"running", "done"}, steps
        a_bytes = _read(url, a, name_a, secret_file)
        assert len(a_bytes.strip()) == 32

        # the cache works for its owner: the same spec again is cached (no sandbox)
        again, steps = _build(url, a, name_a, with_list)
        assert steps[1] == {"cached"} and again.layers == info_a.layers, steps

        # the same tenant with another build network runs the step again
        info_a2, steps = _build(url, a, name_a2, without)
        assert steps[1] == {"running", "done"}, steps
        assert info_a2.layers[-1] != info_a.layers[-1]

        # another tenant: the same step text, no network, another name: it runs, never cached
        info_b, steps = _build(url, b, name_b, without)
        assert "cached" not in steps[1] and steps[1] == {"running", "done"}, steps
        assert info_b.layers[-1] not in (info_a.layers[-1], info_a2.layers[-1])
        b_bytes = _read(url, b, name_b, secret_file)
        assert len(b_bytes.strip()) == 32 and b_bytes != a_bytes
        # and B cannot reach A's template by its name either
        with pytest.raises(TemplateNotFound):
            Templates.get(name_a, api_url=url, api_key=b)
    finally:
        _drop(url, a, name_a, name_a2)
        _drop(url, b, name_b)


def test_a_copy_of_the_same_bytes_is_shared_but_reported_done_to_another_tenant(tenants, tmp_path: Path):
    url, a, b = tenants
    tok = secrets.token_hex(6)
    (tmp_path / "data.txt").write_text(f"the same bytes on both sides {tok}\n")
    t = Template.from_template("base").copy("data.txt", f"/opt/wb-copy-{tok}.txt").with_context(tmp_path)
    name_a, name_b = f"sc-ca-{tok}", f"sc-cb-{tok}"
    try:
        info_a, steps = _build(url, a, name_a, t)
        assert steps[1] == {"running", "done"}, steps
        info_b, steps = _build(url, b, name_b, t)
        # the layer is shared by digest, but B's progress is a plain run: "done", never "cached"
        assert steps[1] == {"running", "done"}, steps
        assert info_b.layers == info_a.layers
        # B's own now: cached for B
        _, steps = _build(url, b, name_b, t)
        assert steps[1] == {"cached"}, steps

        # the same bytes with another mtime: not A's layer (its mtimes would tell B when A's file
        # changed); B's own copy, reported done
        t2 = Template.from_template("base").env({"WB_SCENARIO": tok}).copy("data.txt", f"/opt/wb-copy-{tok}.txt")
        t2 = t2.with_context(tmp_path)
        info_a2, steps = _build(url, a, name_a, t2)
        assert steps[2] == {"running", "done"}, steps
        os.utime(tmp_path / "data.txt", (1_000_000_000, 1_000_000_000))
        info_b2, steps = _build(url, b, name_b, t2)
        assert steps[2] == {"running", "done"}, steps
        assert info_b2.layers[-1] != info_a2.layers[-1]
    finally:
        _drop(url, a, name_a)
        _drop(url, b, name_b)


def test_a_build_network_carrying_secrets_is_refused(tenants):
    url, a, _ = tenants
    tok = secrets.token_hex(6)
    secret = Secret("s3cr3t-" + tok, hosts=["private.example"])
    base = Template.from_template("base").run("true")
    with pytest.raises(InvalidArgument, match="takes no secrets"):
        base.network(["private.example"], secrets={"TOKEN": secret})
    with pytest.raises(InvalidArgument, match="takes no secrets"):
        base.network({"allow": ["private.example"], "secrets": {"TOKEN": secret}})
    with pytest.raises(InvalidArgument, match="cannot ask"):  # would have become a plain deny
        base.network(Network(allow=["private.example"], on_unknown="ask"))
    # a client that sends secrets in the build network over the wire: a 400 naming them, nothing built
    name = f"sc-sec-{tok}"
    body = wire.encode(ops.TemplateBuild(name, base.network(["private.example"])), tag_bytes=True)
    body["template"]["build_network"]["secrets"] = {"TOKEN": {"value": secret.value, "hosts": ["private.example"]}}
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/templates",
            json.dumps(body),
            {"Authorization": f"Bearer {a}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    assert resp.status == 400 and "secrets" in text and secret.value not in text, (resp.status, text)
    assert json.loads(text.splitlines()[0])["error"]["code"] == "invalid_argument"
    with pytest.raises(TemplateNotFound):
        Templates.get(name, api_url=url, api_key=a)
