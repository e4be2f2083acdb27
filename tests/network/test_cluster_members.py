"""The proxy's list of cluster members a sandbox may never reach (parsing only: literals, no DNS)."""

from __future__ import annotations

from warmbox.config import ClusterSettings
from warmbox.network.proxy import cluster_members


def test_members_from_node_addresses_the_ray_head_and_the_registry():
    got = cluster_members(
        ["http://203.0.113.5:7000", "https://[2001:db8::7]:8443", "198.51.100.9:9000", "unix:/run/x.sock", ""],
        ClusterSettings(
            ray="ray://198.51.100.7:6379",
            registry="postgresql://wb:pw@203.0.113.20:5432/warmbox?host=203.0.113.21,/var/run/postgresql",
        ),
    )
    assert got == {"203.0.113.5", "2001:db8::7", "198.51.100.9", "198.51.100.7", "203.0.113.20", "203.0.113.21"}


def test_one_host_has_no_members():
    assert cluster_members([], ClusterSettings()) == set()
    assert cluster_members([], ClusterSettings(registry="postgresql://wb@/warmbox?host=/tmp/wbpg-1")) == set()
