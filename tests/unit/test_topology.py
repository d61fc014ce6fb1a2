"""Topologies: validation, presets, YAML files, point-to-point pair rates."""

from __future__ import annotations

import pytest

from shardshift.collectives.topology.io import load_topology, topology_from_dict
from shardshift.collectives.topology.model import Link, Topology, pair_rates
from shardshift.collectives.topology.presets import DGX1V_NVLINKS, cluster, dgx1v, fat_tree, full, preset, ring
from support import DOCS

GB = 1e9


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: Link(0, 0, 1.0), "self-loop"),
        (lambda: Link(0, 1, 0.0), "capacity 0.0"),
        (lambda: Link(0, 1, float("inf")), "finite rate"),
        (lambda: Link(0, 1, 1.0, -1.0), "latency"),
        (lambda: Link(-1, 1, 1.0), "node id"),
        (lambda: Topology(0, ()), "at least 1 compute rank"),
        (lambda: Topology(2, (Link(0, 1, 1.0), Link(0, 1, 2.0))), "merge parallel links"),
        (lambda: Topology(2, (Link(0, 2, 1.0),)), r"nodes 0\.\.1"),
        (lambda: Topology(2, (Link(0, 1, 1.0),), names=("a",)), "one per node"),
        (lambda: Topology(2, (Link(0, 1, 1.0),), names=("a", "a")), "distinct"),
        (lambda: Topology(2, (), num_switches=-1), "num_switches"),
    ],
)
def test_bad_topologies_are_refused_with_a_reason(build, needle):
    with pytest.raises(ValueError, match=needle):
        build()


def test_topology_helpers():
    t = Topology(2, (Link(0, 2, 3.0), Link(2, 1, 2.0), Link(1, 0, 1.0)), num_switches=1)
    assert t.num_nodes == 3 and t.is_switch(2) and not t.is_switch(1)
    assert t.names == ("0", "1", "sw0")
    assert t.link(0, 2).capacity == 3.0 and t.link(2, 0) is None and t.link_id(1, 0) == 2
    assert t.out_capacity(0) == 3.0 and t.in_capacity(0) == 1.0
    r = t.reversed()
    assert r.link(2, 0).capacity == 3.0 and r.link(0, 1).capacity == 1.0
    assert t.capacity_matrix()[2, 1] == 2.0


# ---------------------------------------------------------------- presets
def test_dgx1v_nvlink_graph_matches_the_reference():
    t = dgx1v(pcie=False)
    assert t.num_ranks == 8 and t.num_switches == 0 and len(t.links) == 32
    doubles = {(a, b) for a, b, k in DGX1V_NVLINKS if k == 2}
    assert len(doubles) == 8 and len(DGX1V_NVLINKS) == 16
    for a, b, k in DGX1V_NVLINKS:
        assert t.link(a, b).capacity == t.link(b, a).capacity == k * 25 * GB
    assert t.link(0, 5) is None and t.link_unit == 25 * GB
    # Every GPU has six NVLinks (six link units out).
    assert all(t.out_capacity(g) == 6 * 25 * GB for g in range(8))


def test_dgx1v_subset_is_renumbered_in_the_given_order():
    t = dgx1v([3, 0, 7], pcie=False)
    assert t.names == ("gpu3", "gpu0", "gpu7")
    assert t.link(0, 1).capacity == 50 * GB  # gpu3-gpu0 double link
    assert t.link(0, 2).capacity == 25 * GB  # gpu3-gpu7 single link
    assert t.link(1, 2) is None  # gpu0-gpu7: no NVLink


def test_dgx1v_pcie_fallback_is_one_switch():
    t = dgx1v([0, 5])
    assert t.num_switches == 1 and t.names[-1] == "pcie"
    assert t.link(0, 1) is None
    assert t.link(0, 2).capacity == t.link(2, 1).capacity == 10 * GB


@pytest.mark.parametrize(
    "gpus, needle",
    [([], "empty"), ([8], "not a DGX-1 GPU"), ([1, 1], "repeats"), (["a"], "not a DGX-1 GPU")],
)
def test_dgx1v_bad_gpus(gpus, needle):
    with pytest.raises(ValueError, match=needle):
        dgx1v(gpus)


def test_ring_full_fat_tree_shapes():
    assert len(ring(5).links) == 10 and len(ring(2).links) == 2
    assert len(ring(4, bidirectional=False).links) == 4
    assert len(full(4).links) == 12
    t = fat_tree(20, hosts_per_leaf=8)  # 3 leaves, 8 spines
    assert (t.num_ranks, t.num_switches) == (20, 11)
    assert len(t.links) == 2 * 20 + 2 * 3 * 8
    one = fat_tree(4, hosts_per_leaf=8)
    assert one.num_switches == 1 and len(one.links) == 8
    with pytest.raises(ValueError, match="spines >= 1"):
        fat_tree(20, hosts_per_leaf=8, spines=0)
    with pytest.raises(ValueError, match="n=1"):
        ring(1)


def test_preset_dispatch_and_errors():
    assert preset("fat_tree", hosts=4).num_ranks == 4
    with pytest.raises(ValueError, match="unknown topology preset 'torus'"):
        preset("torus")
    with pytest.raises(ValueError, match="its parameters are"):
        preset("ring", size=3)


def _neighbours(t: Topology, node: int) -> list[str]:
    return sorted(t.names[l.dst] for l in t.links if l.src == node)


def test_cluster_with_rails():
    """3 hosts of 8 GPUs, 2 hosts a leaf: 2 groups x 8 rail leaves, 2 spines (hosts_per_leaf)."""
    t = cluster(3, hosts_per_leaf=2)
    assert (t.num_ranks, t.num_switches) == (24, 3 + 16 + 2)
    assert t.names[11] == "h1.gpu3" and t.link_unit == 50e9 and t.name == "cluster3x8-rails"
    gpu, nvswitch, leaf = 11, t.names.index("h1.nvswitch"), t.names.index("leaf0.rail3")
    assert _neighbours(t, gpu) == ["h1.nvswitch", "leaf0.rail3"]  # GPU 3 on NIC 3, rail 3
    assert t.link(gpu, nvswitch).capacity == t.link(nvswitch, gpu).capacity == 450e9
    assert t.link(gpu, nvswitch).latency == 2e-6 and t.link(gpu, leaf).latency == 5e-6
    assert t.link(gpu, leaf).capacity == t.link(leaf, gpu).capacity == 50e9
    assert _neighbours(t, t.names.index("leaf1.rail3")) == ["h2.gpu3", "spine0", "spine1"]
    # GPU-NVSwitch and NIC-leaf cables, and every leaf to every spine, both ways.
    assert len(t.links) == 2 * (24 + 24 + 16 * 2)
    # Non-blocking: a leaf's uplinks carry what its hosts_per_leaf hosts' NICs can send it.
    up = sum(l.capacity for l in t.links if l.src == leaf and t.names[l.dst].startswith("spine"))
    assert up == t.out_capacity(leaf) - up == 2 * 50e9


def test_cluster_without_rails_is_a_fat_tree_of_hosts():
    t = cluster(4, hosts_per_leaf=2, spines=4, rails=False)
    assert t.num_switches == 4 + 2 + 4 and t.name == "cluster4x8-fat-tree"
    leaf = t.names.index("leaf1")
    assert _neighbours(t, 16) == ["h2.nvswitch", "leaf1"]
    assert sum(1 for l in t.links if l.dst == leaf and l.src < t.num_ranks) == 16  # 2 hosts x 8 NICs
    assert t.link(leaf, t.names.index("spine3")).capacity == 16 * 50e9 / 4


def test_cluster_shares_a_nic_between_gpus_and_gives_a_single_gpu_every_nic():
    shared = cluster(2, gpus_per_host=4, nics_per_host=2, hosts_per_leaf=2)
    nic = shared.names.index("h1.nic1")
    assert _neighbours(shared, nic) == ["h1.gpu2", "h1.gpu3", "leaf0.rail1"]
    rates = pair_rates(shared)
    assert rates[(0, 4)] == 50e9 and rates[(0, 1)] == 450e9  # across hosts: one NIC
    host = cluster(4, gpus_per_host=1, hosts_per_leaf=4)  # a rank per host, its 8 NICs on 8 rails
    assert host.num_switches == 8 + 4 and _neighbours(host, 0) == [f"leaf0.rail{i}" for i in range(8)]


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"hosts": 0}, r"hosts=0: give an int >= 1"),
        ({"hosts": 2, "gpus_per_host": 0}, r"gpus_per_host=0"),
        ({"hosts": 2, "nics_per_host": 2.5}, r"nics_per_host=2.5"),
        ({"hosts": 2, "nic_bandwidth": -1}, r"nic_bandwidth=-1: give a rate > 0"),
        ({"hosts": 2, "intra_bandwidth": float("inf")}, r"intra_bandwidth=inf"),
        ({"hosts": 2, "latency": -1e-6}, r"latency=-1e-06: give seconds >= 0"),
        ({"hosts": 2, "rails": "yes"}, r"rails='yes': give true"),
        ({"hosts": 4, "hosts_per_leaf": 2, "spines": 0}, r"16 leaves need spines >= 1"),
        ({"hosts": 2, "gpus": 8}, r"its parameters are hosts, gpus_per_host"),
    ],
)
def test_cluster_refuses_bad_parameters(params, needle):
    with pytest.raises(ValueError, match=needle):
        preset("cluster", **params)


def test_shipped_cluster_file_reads_its_units(tmp_path):
    t = load_topology(DOCS / "topologies" / "cluster-dynatrain.yaml")
    want = cluster(64, spines=16)
    assert (t.num_ranks, t.num_switches, t.names) == (512, want.num_switches, want.names)
    assert [(l.src, l.dst, l.capacity) for l in t.links] == [(l.src, l.dst, l.capacity) for l in want.links]
    assert [l.latency for l in t.links] == pytest.approx([l.latency for l in want.links])
    path = tmp_path / "c.yaml"
    path.write_text("preset: cluster\nhosts: 2\nnic_bandwidth: 200 Gbit/s\nintra_latency: 1 us\nrails: false\n")
    small = load_topology(path)
    assert small.link(0, 2 * 8 + 2).capacity == 25e9  # GPU 0 to the one leaf
    assert small.link(0, 16).latency == pytest.approx(1e-6)  # GPU 0 to its NVSwitch


# ---------------------------------------------------------------- YAML
def test_yaml_explicit_form(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(
        """
name: lab
ranks: [a, b, c]
switches: [tor]
link_unit: 1 Gbit/s
latency: 5 us
links:
  - {between: [a, b], bandwidth: 1 Gbit/s}
  - {from: 2, to: tor, bandwidth: 200 Mbit/s, latency: 1 ms}
  - {from: tor, to: a, bandwidth: 100 MB/s}
"""
    )
    t = load_topology(path)
    assert t.name == "lab" and t.names == ("a", "b", "c", "tor")
    assert t.link(0, 1).capacity == t.link(1, 0).capacity == 125e6
    assert t.link(0, 1).latency == pytest.approx(5e-6)
    assert t.link(2, 3).capacity == 25e6 and t.link(2, 3).latency == pytest.approx(1e-3)
    assert t.link(3, 0).capacity == 100e6 and t.link_unit == 125e6


def test_yaml_preset_form(tmp_path):
    path = tmp_path / "dgx.yaml"
    path.write_text("preset: dgx1v\ngpus: [0, 1, 2, 3]\npcie: false\n")
    assert load_topology(path) == dgx1v([0, 1, 2, 3], pcie=False)
    path.write_text("preset: ring\nn: 3\nbandwidth: 1 Gbit/s\n")
    assert load_topology(path).link(0, 1).capacity == 125e6


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"ranks": 2}, "give 'ranks'"),
        ({"ranks": 2, "links": [], "colour": "red"}, "unknown keys"),
        ({"ranks": 2, "links": [{"from": 0, "to": 5, "bandwidth": 1}]}, "rank 5 is out of range"),
        ({"ranks": 2, "links": [{"from": 0, "to": "x", "bandwidth": 1}]}, "unknown node 'x'"),
        ({"ranks": 2, "links": [{"from": 0, "to": 1}]}, "give a bandwidth"),
        ({"ranks": 2, "links": [{"between": [0], "bandwidth": 1}]}, "two nodes"),
        ({"ranks": 2, "links": [{"from": 0, "bandwidth": 1}]}, "'from' and 'to'"),
        ({"ranks": 0, "links": []}, "count >= 1"),
        ({"preset": "torus"}, "unknown preset"),
        ({"version": 2, "ranks": 1, "links": []}, "version 2"),
        ([1, 2], "top level must be a mapping"),
    ],
)
def test_yaml_errors_say_what_to_fix(data, needle):
    with pytest.raises(ValueError, match=needle):
        topology_from_dict(data)


def test_load_topology_reports_file_problems(tmp_path):
    with pytest.raises(ValueError, match="missing.yaml: no such file"):
        load_topology(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ranks: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_topology(bad)


# ---------------------------------------------------------------- pair rates
def test_pair_rates_direct_and_through_switches():
    # ranks 0, 1, 2; switches 3, 4. 0→1 direct; 0→3→4→2 with bottleneck 2; 2→3→1 bottleneck 1.
    links = [Link(0, 1, 9.0), Link(0, 3, 5.0), Link(3, 4, 2.0), Link(4, 2, 7.0), Link(2, 3, 1.0),
             Link(3, 1, 4.0), Link(1, 0, 3.0)]  # fmt: skip
    rates = pair_rates(Topology(3, tuple(links), num_switches=2))
    assert rates == {(0, 1): 9.0, (0, 2): 2.0, (2, 1): 1.0, (1, 0): 3.0}


def test_pair_rates_never_relay_through_ranks():
    rates = pair_rates(ring(4, bandwidth=10.0))
    assert (0, 2) not in rates and rates[(0, 1)] == 10.0 and len(rates) == 8


def test_pair_rates_of_presets():
    t = fat_tree(12, hosts_per_leaf=4, uplink_bandwidth=5e9)
    rates = pair_rates(t)
    assert len(rates) == 12 * 11
    assert rates[(0, 1)] == 12.5e9  # same leaf
    assert rates[(0, 5)] == 5e9  # across the spine: the uplink is the bottleneck
    d = pair_rates(dgx1v([0, 1, 5]))
    assert d[(0, 1)] == 25e9 and d[(0, 2)] == 10e9 and d[(2, 1)] == 50e9


# ---------------------------------------------------------------- a group's part of the network


def test_a_group_sees_its_ranks_links_and_every_switch():
    t = fat_tree(4, hosts_per_leaf=2)  # ranks 0-3, two leaves, spines
    sub = t.restricted([1, 3])
    assert (sub.num_ranks, sub.num_switches) == (2, t.num_switches)
    assert sub.names[:2] == (t.names[1], t.names[3])
    # Every link of the sub-network is a link of the network between the nodes it maps back to.
    back = [1, 3, *range(4, t.num_nodes)]
    assert {(back[l.src], back[l.dst], l.capacity) for l in sub.links} == {
        (l.src, l.dst, l.capacity) for l in t.links if l.src in back and l.dst in back}


def test_a_group_whose_ranks_only_other_ranks_join_is_refused():
    with pytest.raises(ValueError, match=r"ranks 2 and 0 of the group of ranks \[0, 2\] are not joined"):
        ring(4, bidirectional=True).restricted([0, 2])
    assert ring(4).restricted([1, 2]).num_ranks == 2  # neighbours keep their link


def test_a_group_takes_a_preset_at_its_size_and_its_part_of_a_file_of_the_whole_job(tmp_path):
    from shardshift.collectives.topology.spec import group_topology

    path = tmp_path / "net.yaml"
    path.write_text("ranks: 4\nlinks:\n  - {between: [0, 1], bandwidth: 1 Gbit/s}\n"
                    "  - {between: [1, 2], bandwidth: 2 Gbit/s}\n  - {between: [2, 3], bandwidth: 1 Gbit/s}\n"
                    "  - {between: [3, 0], bandwidth: 1 Gbit/s}\n")
    assert group_topology("ring", [0, 2], 4).num_ranks == 2  # a preset is sized to the group
    whole = group_topology(str(path), [0, 1, 2, 3], 4)
    assert whole == load_topology(str(path))
    part = group_topology(str(path), [1, 2], 4)
    assert [(l.src, l.dst, l.capacity) for l in part.links] == [(0, 1, 2e9 / 8), (1, 0, 2e9 / 8)]
    with pytest.raises(ValueError, match="not joined"):
        group_topology(str(path), [0, 2], 4)
    with pytest.raises(ValueError, match="has 4 ranks, but the group has 2 and the job 8"):
        group_topology(str(path), [0, 1], 8)


def test_an_elastic_worlds_topology_comes_from_its_workers_hosts(tmp_path):
    """`hosts_topology`: ranks on different hosts linked at their hosts' rate (the direct link, else
    through switches), ranks of one host at the file's fastest rate; a preset is sized to the world;
    a host the file does not name is refused, naming it."""
    from shardshift.collectives.topology.spec import hosts_topology

    path = tmp_path / "hosts.yaml"
    path.write_text("name: lab\nranks: [a, b, c]\nswitches: [tor]\nlinks:\n"
                    "  - {between: [a, b], bandwidth: 10 Gbit/s}\n"
                    "  - {between: [b, tor], bandwidth: 2 Gbit/s}\n"
                    "  - {between: [c, tor], bandwidth: 1 Gbit/s}\n")
    world = hosts_topology(str(path), ["a", "c", "a", "b"])
    assert world.num_ranks == 4 and world.names == ("a/0", "c/0", "a/1", "b/0")
    rate = {(link.src, link.dst): link.capacity for link in world.links}
    assert rate[(0, 2)] == rate[(2, 0)] == 10e9 / 8  # one host: the file's fastest rate
    assert rate[(0, 3)] == 10e9 / 8 and rate[(3, 1)] == 1e9 / 8  # b -> tor -> c: its narrowest link
    assert (0, 1) not in rate  # a reaches c only through b, a rank: no point-to-point route
    assert hosts_topology("full:2Gbit/s", ["x", "y", "x"]).num_ranks == 3
    with pytest.raises(ValueError, match=r"no rank named d, e \(a worker's host\).*a, b, c are named"):
        hosts_topology(str(path), ["a", "e", "d"])
