"""A named volume in a cluster: its disk stays on the node that made it. Two homes on this host as
nodes "a" and "b" sharing one registry: b sees the volume (and where it is) but refuses to mount or
delete it, by name, with VolumeElsewhere naming node a, before doing anything; a keeps using it."""

from __future__ import annotations

import os

import pytest

from warmbox import Sandbox, Volume, VolumeElsewhere
from warmbox.engine import volumes
from warmbox.models import State

pytestmark = pytest.mark.sandbox


def test_a_volume_made_on_node_a_is_refused_by_node_b_naming_node_a(node_homes, tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_OBJECT_STORE", str(tmp_path / "store"))  # pause/resume across nodes
    a = node_homes.add("a")
    b = node_homes.add("b", share=a)
    vol = Sandbox.create_volume("data", 64, home=a.home)
    disk = volumes.disk_of_name(a, "", "data")
    assert vol.node == "a" and os.path.isfile(disk)
    sb = Sandbox.create(
        tier="container", template="shell", timeout=120, pool=False, home=a.home, volumes=[Volume("data", "/data")]
    )
    sid = sb.sandbox_id
    resumed = None
    try:
        sb.commands.run("echo written on a > /data/note")
        seen = Sandbox.get_volume("data", home=b.home)
        assert (seen.node, seen.mounted_by, seen.allocated_mb) == ("a", (sid,), 0)
        assert [v.node for v in Sandbox.list_volumes(home=b.home)] == ["a"]

        with pytest.raises(VolumeElsewhere) as e:
            Sandbox.create(
                tier="container", template="shell", timeout=60, pool=False, home=b.home, volumes=[Volume("data", "/d")]
            )
        assert (e.value.node, e.value.volume) == ("a", "data") and "node 'a'" in str(e.value)
        assert [i for i, _ in b.registry.sandboxes.list(include_pooled=True, local=True)] == []  # nothing started on b

        sb.pause()
        with pytest.raises(VolumeElsewhere) as e:  # a resume on b would mount it there
            Sandbox.resume(sid, home=b.home)
        assert e.value.node == "a"
        assert b.info(sid)[0].state is State.PAUSED and b.registry.nodes.node_of(sid) == "a"
        resumed = Sandbox.resume(sid, home=a.home)  # where the volume is: as before
        assert resumed.commands.run("cat /data/note").stdout == "written on a\n"
    finally:
        (resumed or sb).kill()

    with pytest.raises(VolumeElsewhere):  # only a deletes its disk
        Sandbox.delete_volume("data", home=b.home)
    assert os.path.isfile(disk) and Sandbox.get_volume("data", home=a.home).node == "a"
    Sandbox.delete_volume("data", home=a.home)
    assert not os.path.exists(disk)
