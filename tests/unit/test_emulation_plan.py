"""Link emulation, the parts that need no namespaces: the plan of namespaces, addresses and tc
classes, namespace names, and the rates of the command line and of rates files."""

from __future__ import annotations

import pytest

from shardshift.netemu.cli import rates_from_file, rates_from_spec
from shardshift.netemu.network import EmulatedNetwork
from shardshift.netemu.shaping import FRAME_OVERHEAD, EmulationPlan, parse_network_name, uniform_rates

MBIT = 1e6 / 8  # bytes/s
# 4 ranks with heterogeneous rates; 0 → 1 is fast while 1 → 0 is slow.
RATES = uniform_rates(4, 300 * MBIT) | {
    (0, 1): 1000 * MBIT, (1, 0): 200 * MBIT, (2, 3): 600 * MBIT, (3, 2): 450 * MBIT}


def test_plan_rejects_missing_and_bad_pairs():
    rates = uniform_rates(3, 50 * MBIT)
    del rates[(2, 0)]
    with pytest.raises(ValueError, match=r"missing \[\(2, 0\)\].*uniform_rates"):
        EmulationPlan.build(rates, 3, "t1x0")
    with pytest.raises(ValueError, match="must be > 0"):
        EmulationPlan.build(uniform_rates(3, 0.0), 3, "t1x0")
    with pytest.raises(ValueError, match="2 <= n"):
        EmulationPlan.build({}, 1, "t1x0")
    with pytest.raises(ValueError, match="letters"):
        EmulatedNetwork(uniform_rates(2, 50 * MBIT), 2, prefix="a-1")


def test_plan_warns_outside_reliable_range():
    with pytest.warns(UserWarning, match="100 Mbit/s - 2 Gbit/s"):
        EmulationPlan.build(uniform_rates(2, 10 * MBIT), 2, "t1x0")


def test_tc_batch_one_corrected_class_per_destination():
    plan = EmulationPlan.build(RATES, 4, "t1x0")
    lines = plan.tc_batch(1)
    classes = [line for line in lines if line.startswith("class add")]
    assert len(classes) == 3  # destinations 0, 2, 3: not itself
    # 1 → 0 at 200 Mbit/s payload is configured at 200 * 1514/1448 Mbit/s of frames.
    assert f"rate {round(200e6 * FRAME_OVERHEAD)}bit ceil {round(200e6 * FRAME_OVERHEAD)}bit" \
        in classes[0]
    dst_filters = [line for line in lines if "match ip dst" in line]
    assert [f.split("match ip dst ")[1].split("/")[0] for f in dst_filters] == \
        [plan.address(0), plan.address(2), plan.address(3)]
    assert sum("flowid 1:0" in line for line in lines) == 1  # the pure-ACK bypass


def test_namespace_names_carry_owner():
    assert parse_network_name("ssn123x4-r2", "ssn") == ("ssn123x4", 123)
    assert parse_network_name("ssn123x4-br", "ssn") == ("ssn123x4", 123)
    assert parse_network_name("ssnx123x4-br", "ssn") is None
    assert parse_network_name("other-r0", "ssn") is None


def test_rate_spec_and_file(tmp_path):
    rates = rates_from_spec("1gbit,0-1=200mbit", 3)
    assert rates[(0, 1)] == 25e6 and rates[(1, 0)] == 125e6 and len(rates) == 6
    full = rates_from_spec(",".join(f"{k}00mbit" for k in range(1, 7)), 3)
    assert full[(0, 1)] == 100 * MBIT and full[(2, 1)] == 600 * MBIT
    with pytest.raises(ValueError, match="no rate for pairs 0-2"):
        rates_from_spec("0-1=1gbit", 3)
    path = tmp_path / "links.yaml"
    path.write_text("nproc: 3\ndefault: 1gbit\nrates:\n  '2-1': 300mbit\n")
    rates, n = rates_from_file(path, None)
    assert n == 3 and rates[(2, 1)] == 300 * MBIT and rates[(1, 2)] == 1000 * MBIT
    with pytest.raises(ValueError, match="differs"):
        rates_from_file(path, 4)
    path.write_bytes(b"nproc: \xec\x00")
    with pytest.raises(ValueError, match=rf"^--rates-file {path}: not UTF-8 text \(byte 7 is 0xec\); give a JSON or YAML"):
        rates_from_file(path, None)
