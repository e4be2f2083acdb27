"""The router's decisions without Ray or nodes: which node an operation goes to, the monitor's rule,
drain refusals, and that a call in flight to a node that goes down ends at once (never a hang).

The registry is a real one (SQLite in a temp dir: the same class and SQL the cluster uses on
PostgreSQL, shared here by "nodes" that are Registry objects with their node names)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest

from warmbox import operations as ops
from warmbox.cluster import drain as draining
from warmbox.cluster.monitor import Monitor, verdict
from warmbox.cluster.router import (
    ADMIN_HEADER,
    KEY_HEADER,
    RULES_BY_OP,
    TENANT_HEADER,
    Cluster,
    ClusterFront,
    Rule,
    merge_doctor,
    merge_gc,
    merge_pools,
    node_load,
    peer_headers,
    rule_of,
    want_of,
)
from warmbox.config import load
from warmbox.errors import (
    ConnectionLost,
    DrainRefused,
    Forbidden,
    InvalidArgument,
    NoCapacity,
    NodeNotFound,
    SandboxLost,
    SandboxNotFound,
    VolumeElsewhere,
    VolumeNotFound,
)
from warmbox.models import Limits, NodeInfo, NodeUsage, PoolStatus, State, Tenant, TierStatus
from warmbox.storage.registry import Registry

TOKEN = "t" * 32


@pytest.fixture
def two_nodes(tmp_path):
    """A registry shared by the router and two nodes a and b (both up, container tier, 4 slots)."""
    path = tmp_path / "registry.db"
    router = Registry(path)
    nodes = {n: Registry(path, n) for n in ("a", "b")}
    for i, n in enumerate(nodes):
        router.nodes.join_node(
            NodeInfo(
                name=n,
                address=f"http://127.0.0.1:{9 + i}",
                ray_node_id=f"ray-{n}",
                slots=4,
                memory_mb=4096,
                tiers=("container",),
            )
        )
    cluster = Cluster(router, TOKEN, lambda: load(tmp_path / "home"))
    yield cluster, nodes
    for r in (router, *nodes.values()):
        r.close()


def _sandbox(reg: Registry, n: int, tenant: Tenant | None = None, state: State = State.READY) -> str:
    sid = f"sb-{n:012x}"
    reg.sandboxes.allocate(sid, "container", "base", 3600, Limits(), "/nonexistent", "/nonexistent", tenant=tenant)
    reg.sandboxes.set_state(sid, State.READY, "started")
    if state is State.PAUSED:
        reg.sandboxes.set_state(sid, State.PAUSED, "paused")
    return sid


def test_every_operation_has_exactly_one_rule():
    for op, cls in ops.REQUESTS.items():
        rule = rule_of(cls)
        names_sandbox = any(f.name == "sandbox_id" for f in dataclasses.fields(cls))
        assert (rule is Rule.OWNER) == (names_sandbox and cls not in RULES_BY_OP), op
    assert rule_of(ops.Create) is Rule.PLACE and rule_of(ops.Resume) is Rule.RESUME
    assert rule_of(ops.NodeDrain) is Rule.ROUTER
    with pytest.raises(InvalidArgument):
        rule_of(int)  # type: ignore[arg-type]


def test_peer_headers_name_the_caller_and_root_is_no_header():
    assert peer_headers(None) == {}
    assert peer_headers(Tenant("acme")) == {TENANT_HEADER: "acme"}
    assert peer_headers(Tenant("acme", admin=True, key_id="k-1")) == {
        TENANT_HEADER: "acme",
        ADMIN_HEADER: "1",
        KEY_HEADER: "k-1",
    }


def test_merges_of_per_host_answers():
    got = merge_doctor(
        [
            ("a", [TierStatus("container", True, "runc 1.1"), TierStatus("microvm", False, "no qemu")]),
            ("b", [TierStatus("container", False, "no runc"), TierStatus("microvm", False, "no kvm")]),
        ]
    )
    assert got == [
        TierStatus("container", True, "on a: runc 1.1"),
        TierStatus("microvm", False, "a: no qemu; b: no kvm"),
    ]
    r = merge_gc([ops.TemplateGcReport(("l1",), (), 10, True), ops.TemplateGcReport(("l2",), ("r",), 5, True, ("k",))])
    assert r == ops.TemplateGcReport(("l1", "l2"), ("r",), 15, True, ("k",))
    p = PoolStatus("p", "container", "base", 0, 4, 3, 1, 1, 7, 2, 0, "", 1.0, 2.0, 3.0)
    q = dataclasses.replace(p, ready=2, warming=0)
    assert merge_pools([[p], [q, dataclasses.replace(p, name="o")]]) == [
        dataclasses.replace(p, ready=3, warming=1),  # each node's own counts summed; the shared rest once
        dataclasses.replace(p, name="o"),
    ]


def test_monitor_verdict():
    now = time.time()
    n = NodeInfo(name="a", ray_node_id="ray-a", heartbeat_at=now - 1)
    assert verdict(n, frozenset({"ray-a"}), now, 10) == ""
    assert verdict(n, None, now, 10) == ""  # Ray's view unknown: heartbeats alone
    assert "Ray reports" in verdict(n, frozenset({"ray-b"}), now, 10)
    assert "no heartbeat for 11" in verdict(dataclasses.replace(n, heartbeat_at=now - 11), None, now, 10)
    assert verdict(dataclasses.replace(n, state="down"), frozenset(), now, 10) == ""


def test_operations_go_to_the_owner_and_paused_ones_move_off_a_down_node(two_nodes):
    async def main() -> None:
        cluster, nodes = two_nodes
        front = ClusterFront(cluster, None)
        on_a = _sandbox(nodes["a"], 1)
        paused = _sandbox(nodes["a"], 2, state=State.PAUSED)
        assert (await front._target(on_a)).name == "a"
        assert (await front._target(paused)).name == "a"  # its node is up: resumed there
        with pytest.raises(SandboxNotFound):
            await front._target("sb-0000000000ff")
        cluster.registry.nodes.mark_node_down("a", "test")
        cluster.nodes(fresh=True)
        # a lost one: any up node answers from the registry (SandboxLost there); the paused one moves
        assert (await front._target(on_a)).name == "b"
        assert cluster.registry.sandboxes.get(on_a)[0].state is State.LOST
        assert (await front._target(paused)).name == "b"
        assert cluster.registry.nodes.node_of(paused) == "b"

    asyncio.run(main())


def test_a_paused_sandbox_of_a_draining_node_moves_but_a_live_one_stays(two_nodes):
    async def main() -> None:
        cluster, nodes = two_nodes
        front = ClusterFront(cluster, None)
        live = _sandbox(nodes["a"], 1)
        paused = _sandbox(nodes["a"], 2, state=State.PAUSED)
        cluster.registry.nodes.set_node_state("a", "draining")
        cluster.nodes(fresh=True)
        assert (await front._target(live)).name == "a"
        assert (await front._target(paused)).name == "b"

    asyncio.run(main())


def test_another_tenants_paused_sandbox_is_not_moved(two_nodes):
    async def main() -> None:
        cluster, nodes = two_nodes
        theirs = _sandbox(nodes["a"], 3, tenant=Tenant("other"), state=State.PAUSED)
        cluster.registry.nodes.mark_node_down("a", "test")
        cluster.nodes(fresh=True)
        with pytest.raises(SandboxNotFound):
            await ClusterFront(cluster, Tenant("me"))._target(theirs)
        assert cluster.registry.nodes.node_of(theirs) == "a"

    asyncio.run(main())


def test_placement_spreads_a_burst_and_skips_dead_draining_and_full_nodes(two_nodes):
    cluster, _ = two_nodes
    from warmbox.cluster.placement import Want

    want = Want("container", memory_mb=512)
    got = [cluster.place(want).name for _ in range(4)]
    assert sorted(got) == ["a", "a", "b", "b"]  # booked between reads: not all on the "best" node
    cluster.nodes(fresh=True)
    cluster.ray_alive = frozenset({"ray-b"})  # Ray says a's raylet is dead
    assert {cluster.place(want).name for _ in range(3)} == {"b"}
    cluster.ray_alive = None
    cluster.registry.nodes.set_node_state("b", "draining")
    cluster.nodes(fresh=True)
    assert {cluster.place(want).name for _ in range(3)} == {"a"}
    with pytest.raises(NoCapacity, match="does not run tier gvisor"):
        cluster.place(Want("gvisor"))


def test_placement_prefers_a_node_with_a_ready_pooled_sandbox_of_the_shape(two_nodes):
    cluster, nodes = two_nodes
    from warmbox.cluster.placement import Want

    for i in range(2):  # a holds more: without the pool, b (more free slots) would win
        _sandbox(nodes["a"], 10 + i)
    nodes["b"].sandboxes.allocate("sb-0000000000aa", "container", "base", 3600, Limits(), "/x", "/x", pool="p")
    nodes["b"].sandboxes.allocate("sb-0000000000ab", "container", "base", 3600, Limits(), "/x", "/x", pool="p")
    nodes["a"].sandboxes.allocate("sb-0000000000ac", "container", "base", 3600, Limits(), "/x", "/x", pool="p")
    for sid in ("sb-0000000000aa", "sb-0000000000ab", "sb-0000000000ac"):
        cluster.registry.sandboxes.set_state(sid, State.POOLED, "warm")
    cluster.registry.sandboxes.set_state("sb-0000000000ac", State.READY, "claimed")
    cluster.nodes(fresh=True)
    assert cluster.usage()["a"].live == 3 and cluster.usage()["b"].pooled == (("p", 2),)
    assert cluster.place(Want("container", shape="p")).name == "b"
    assert cluster.place(Want("container", shape="p")).name == "b"
    assert cluster.place(Want("container", shape="p")).name == "b"  # none left there: b still has more free slots
    # a and b now hold 3 slots and 1536 MiB each (b's claimed pooled sandboxes keep theirs): a tie
    # the router's salt breaks, one each
    assert {cluster.place(Want("container")).name, cluster.place(Want("container")).name} == {"a", "b"}


def test_ready_needs_an_up_node(two_nodes):
    cluster, _ = two_nodes
    assert cluster.ready() == ""
    for n in ("a", "b"):
        cluster.registry.nodes.mark_node_down(n, "test")
    assert "no node of the cluster is up" in cluster.ready()


def test_drain_refusals(two_nodes):
    async def main() -> None:
        cluster, _ = two_nodes
        with pytest.raises(NodeNotFound):
            await draining.drain(cluster, "zz")
        with pytest.raises(Forbidden):
            await ClusterFront(cluster, Tenant("acme")).handle(ops.NodeDrain("a"))
        cluster.registry.nodes.mark_node_down("b", "test")
        with pytest.raises(DrainRefused, match="last node up"):
            await draining.drain(cluster, "a")
        with pytest.raises(DrainRefused, match="down already"):
            await draining.drain(cluster, "b")
        assert cluster.nodes(fresh=True)["a"].state == "up"  # a refused drain changes nothing

    asyncio.run(main())


def test_a_call_in_flight_to_a_node_that_goes_down_ends_at_once(two_nodes):
    """A node that accepts the connection and never answers (a host that froze): when the node is
    marked down the call ends with SandboxLost (its sandbox) or ConnectionLost (anything else)."""

    async def main() -> None:
        cluster, nodes = two_nodes
        hung = socket.socket()
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        try:
            port = hung.getsockname()[1]
            nodes["a"].nodes.join_node(
                NodeInfo(
                    name="a",
                    address=f"http://127.0.0.1:{port}",
                    ray_node_id="ray-a",
                    slots=4,
                    memory_mb=4096,
                    tiers=("container",),
                )
            )
            cluster.registry.nodes.set_node_state("b", "draining")  # only a takes "any node" operations
            cluster.nodes(fresh=True)
            sid = _sandbox(nodes["a"], 5)
            front = ClusterFront(cluster, None)
            calls = [
                asyncio.ensure_future(front.handle(ops.Exec(sid, "sleep 1000"))),
                asyncio.ensure_future(front.handle(ops.ListSnapshots())),
            ]
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls)
            t0 = time.monotonic()
            cluster.node_down("a", "test: its raylet died")
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
            assert time.monotonic() - t0 < 1.0
            assert isinstance(results[0], SandboxLost) and results[0].node == "a" and results[0].sandbox_id == sid
            assert isinstance(results[1], ConnectionLost) and "node 'a' went down" in str(results[1])
            # another tenant's call on that sandbox, cut the same way, learns nothing of it
            cluster.node_back("a")
            other = asyncio.ensure_future(ClusterFront(cluster, Tenant("other")).handle(ops.Exec(sid, "true")))
            await asyncio.sleep(0.3)
            assert not other.done()  # forwarded: the node would judge the caller
            cluster.node_down("a", "test: again")
            with pytest.raises(SandboxNotFound):
                await asyncio.wait_for(other, 5)
        finally:
            hung.close()
            await cluster.close()

    asyncio.run(main())


def test_monitor_marks_a_silent_node_down_once(two_nodes):
    async def main() -> None:
        cluster, nodes = two_nodes
        sid = _sandbox(nodes["a"], 6)
        paused = _sandbox(nodes["a"], 7, state=State.PAUSED)
        assert nodes["b"].nodes.heartbeat("b", cluster.registry.nodes.nodes()[1].epoch, 0, 0)
        mon = Monitor(cluster, lambda: frozenset({"ray-b"}), heartbeat_timeout_s=60)
        assert await mon.tick() == ["a"]  # Ray: a's raylet is dead
        assert cluster.registry.sandboxes.get(sid)[0].state is State.LOST
        assert cluster.registry.sandboxes.get(paused)[0].state is State.PAUSED
        assert await mon.tick() == []  # already down: nothing more to do
        assert [n.name for n in cluster.up()] == ["b"]

    asyncio.run(main())


def test_a_node_that_stops_answering_gives_the_monitors_verdict(two_nodes):
    """Connections to a's address are refused (its process died) and another router's monitor marks
    it down a second later: the caller gets SandboxLost, not a bare connection error."""
    cluster, nodes = two_nodes

    async def main() -> None:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        nodes["a"].nodes.join_node(
            NodeInfo(name="a", address=f"http://127.0.0.1:{port}", ray_node_id="ray-a", slots=4, memory_mb=4096)
        )
        cluster.nodes(fresh=True)
        sid = _sandbox(nodes["a"], 8)
        call = asyncio.ensure_future(ClusterFront(cluster, None).handle(ops.Info(sid)))
        await asyncio.sleep(1.0)
        assert not call.done()  # the transport retries a refused connection for ~3 s
        nodes["b"].nodes.mark_node_down("a", "raylet gone")  # another router's monitor, on the shared registry
        t0 = time.monotonic()
        with pytest.raises(SandboxLost) as e:
            await asyncio.wait_for(call, 15)
        assert time.monotonic() - t0 < 5 and e.value.node == "a"
        await cluster.close()

    asyncio.run(main())


def test_the_monitors_verdict_while_a_caller_waits_for_it_is_a_typed_error(two_nodes):
    """The connection broke and the caller waits for the monitor; this router's monitor then marks
    the node down (and ends the calls in flight): the waiting caller gets SandboxLost, not a
    cancellation (which the server would answer with a 500)."""
    cluster, nodes = two_nodes

    async def main() -> None:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        nodes["a"].nodes.join_node(NodeInfo(name="a", address=f"http://127.0.0.1:{port}", slots=4, memory_mb=4096))
        cluster.nodes(fresh=True)
        sid = _sandbox(nodes["a"], 9)
        call = asyncio.ensure_future(ClusterFront(cluster, None).handle(ops.Exec(sid, "true")))
        for _ in range(100):  # the transport's retries of a refused connection (~3 s), then the wait
            await asyncio.sleep(0.1)
            if not cluster._inflight.get("a"):
                break
        assert not call.done()
        cluster.node_down("a", "Ray reports its raylet dead")
        with pytest.raises(SandboxLost, match="raylet dead"):
            await asyncio.wait_for(call, 5)
        await cluster.close()

    asyncio.run(main())


def test_a_lost_sandbox_is_said_lost_by_the_router_even_with_no_node_up(two_nodes):
    cluster, nodes = two_nodes

    async def main() -> None:
        sid = _sandbox(nodes["a"], 4)
        for n in ("a", "b"):
            cluster.registry.nodes.mark_node_down(n, "power cut")
        cluster.nodes(fresh=True)
        front = ClusterFront(cluster, None)
        with pytest.raises(SandboxLost, match="power cut") as e:
            await front.handle(ops.Exec(sid, "true"))
        assert e.value.node == "a" and e.value.sandbox_id == sid
        with pytest.raises(NoCapacity, match="no node of the cluster is up"):
            await front.handle(ops.Info(sid))  # a node reads its record: none is up

    asyncio.run(main())


def test_transports_per_key_are_bounded_by_closing_idle_ones(two_nodes):
    cluster, _ = two_nodes

    async def main() -> None:
        node = cluster.nodes()["a"]
        cluster.max_transports = 2
        first = cluster.transport(node, Tenant("t", key_id="k1"))
        assert cluster.transport(node, Tenant("t", key_id="k1")) is first  # one per node and key
        cluster.transport(node, Tenant("t", key_id="k2"))
        cluster.evict_idle_s = 60.0
        cluster.transport(node, Tenant("t", key_id="k3"))
        assert len(cluster._transports) == 3  # none idle long enough: kept
        cluster.evict_idle_s = 0.0
        cluster.transport(node, Tenant("t", key_id="k4"))
        assert len(cluster._transports) == 2  # the two least recently used went
        assert cluster.transport(node, Tenant("t", key_id="k1")) is not first
        await cluster.close()

    asyncio.run(main())


def test_what_mounts_a_volume_goes_to_the_volumes_node(two_nodes):
    cluster, nodes = two_nodes
    t = Tenant("t")
    front = ClusterFront(cluster, t)
    nodes["b"].volumes.add_volume("t", "data", "vol-0000000001", 16, time.time())
    nodes["a"].volumes.add_volume("t", "logs", "vol-0000000002", 16, time.time())
    assert front._volume_home(front._named_volumes(["data"])).name == "b"
    with pytest.raises(VolumeNotFound):
        front._named_volumes(["nope"])
    with pytest.raises(VolumeElsewhere, match="different nodes") as e:
        front._volume_home(front._named_volumes(["data", "logs"]))
    assert e.value.node == "a"
    # a paused sandbox mounting b's volume resumes on b, never where placement would put it
    sid = _sandbox(nodes["a"], 20, tenant=t)
    nodes["a"].volumes.mount_volumes(sid, [("vol-0000000001", "data", "/data", False)], exclusive=False)
    nodes["a"].sandboxes.set_state(sid, State.PAUSED, "paused")
    cluster.registry.nodes.mark_node_down("a", "test")
    cluster.nodes(fresh=True)

    async def main() -> None:
        assert (await front._target(sid)).name == "b"
        assert cluster.registry.nodes.node_of(sid) == "b"
        cluster.registry.nodes.mark_node_down("b", "test")
        cluster.nodes(fresh=True)
        with pytest.raises(VolumeElsewhere, match="on node b, which is down") as e:
            await front._target(sid)
        assert e.value.volume == "data" and e.value.node == "b"

    asyncio.run(main())


def test_placement_counts_the_memory_of_pooled_sandboxes():
    """A node's warm spares hold their memory as a user's sandbox does: the router counts it (it
    counted only their slots), unless a paused sandbox coming back may displace them."""
    from warmbox.cluster.placement import Want, why_not

    n = NodeInfo(name="a", ray_node_id="ray-a", slots=10, memory_mb=2048, tiers=("container",))
    usage = NodeUsage("a", live=1, memory_mb=512, pooled=(("p", 3),), pooled_memory_mb=1536)
    load = node_load(n, usage)
    assert (load.live, load.memory_used_mb) == (4, 2048)
    assert "0 MiB free" in why_not(load, Want("container", memory_mb=256))
    moving = node_load(n, usage, pool_yields=True)
    assert (moving.live, moving.memory_used_mb) == (1, 512) and why_not(moving, Want("container", memory_mb=256)) == ""


def test_the_router_learns_the_pools_from_the_registry(two_nodes):
    """The router has no [pools] of its own: a create of a pool's shape goes where a ready sandbox
    of that pool waits, the pool's shape read from the pooled sandboxes' rows."""
    cluster, nodes = two_nodes
    lim = Limits(memory_mb=500)
    sid = "sb-0000000000f1"
    nodes["b"].sandboxes.allocate(
        sid, "container", "base", 3600, lim, "/nonexistent", "/nonexistent", pool="iso", shape="k"
    )
    nodes["b"].sandboxes.set_state(sid, State.POOLED, "warmed")
    settings = cluster.settings()
    assert "iso" not in settings.pools and settings.pool_for("container", "base", lim) is None
    want = want_of(settings, "container", lim, "base", True, cluster.pools())
    assert want.shape == "iso"
    assert want_of(settings, "container", Limits(), "base", True, cluster.pools()).shape == ""  # another shape
    assert want_of(settings, "gvisor", lim, "base", True, cluster.pools()).shape == ""
    for _ in range(8):  # each create draws with a salt of its own: only b holds one
        cluster.set_view(cluster.registry.nodes.nodes())
        assert cluster.place(want).name == "b"
