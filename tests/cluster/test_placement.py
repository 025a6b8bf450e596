"""Where hosts go on several nodes (the pure choice; tests/cluster/test_ray_nodes.py runs it
on Ray)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from actors.cli import main
from actors.cluster.local_nodes import LocalNodes
from actors.cluster.placement import host_node, standby_node, strategy
from bus.errors import ConfigError


def test_first_hosts_spread_over_the_nodes_by_slot() -> None:
    nodes = ["c", "a", "b"]
    assert [host_node(nodes, s) for s in range(4)] == ["a", "b", "c", "a"]
    assert host_node([], 0) is None


def test_a_standby_is_never_on_its_active_hosts_node() -> None:
    nodes = ["a", "b", "c"]
    for slot in range(6):
        for active in nodes:
            assert standby_node(nodes, active, slot) not in (active, None)
    assert {standby_node(nodes, "a", s) for s in range(4)} == {"b", "c"}  # spread over others
    assert standby_node(["a"], "a", 0) is None  # one node: nowhere else to go


def test_a_host_without_a_node_is_placed_by_ray() -> None:
    assert strategy(None) == "DEFAULT"
    node = "ab" * 28  # a node id's hex form
    assert strategy(node).node_id == node and strategy(node).soft is False


def test_a_local_cluster_needs_two_nodes() -> None:
    with pytest.raises(ConfigError, match="--nodes >= 2"):
        LocalNodes(1)


def test_nodes_and_a_ray_address_are_refused_together() -> None:
    result = CliRunner().invoke(main, ["demo", "--nodes", "2", "--ray-address", "auto"])
    assert result.exit_code == 2, result.output
    assert "--nodes starts a local cluster" in result.output
