"""Sizes, rates and durations, as every command and file reads them (`shardshift.units`)."""

from __future__ import annotations

import pytest

from shardshift.units import format_rate, format_size, parse_duration, parse_rate, parse_size, parse_size_list


def test_sizes_are_binary():
    assert parse_size("64M") == 64 << 20 and parse_size("1g") == 1 << 30 and parse_size("4096") == 4096
    assert parse_size("64MiB") == parse_size("64MB") == 64 << 20 and parse_size("1.5K") == 1536
    assert parse_size(512) == 512
    with pytest.raises(ValueError, match="--budget 'lots' is not a number of bytes"):
        parse_size("lots", "--budget")
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size("0")


def test_size_lists_follow_nccl_tests_doubling():
    assert parse_size_list("1M:8M") == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert parse_size_list("1M:5M") == [1 << 20, 2 << 20, 4 << 20]
    assert parse_size_list("512K,3M") == [512 << 10, 3 << 20]
    with pytest.raises(ValueError, match="not a number of bytes"):
        parse_size_list("lots")
    with pytest.raises(ValueError, match="upper end"):
        parse_size_list("8M:1M")
    with pytest.raises(ValueError, match="names no size"):
        parse_size_list(",")


@pytest.mark.parametrize(
    "text, value",
    [
        ("25 GB/s", 25e9), ("1 Gbit/s", 125e6), ("200Mbit/s", 25e6), ("10 GiB/s", 10 * 2**30),
        (5, 5.0), ("1e9", 1e9), ("8 bit/s", 1.0), ("8 b/s", 1.0), ("3 Gb/s", 375e6),
        ("1gbit", 125e6), ("200Mbit", 25e6), ("200mbit", 25e6), ("100kbit", 12.5e3),  # tc's spelling
    ],
)  # fmt: skip
def test_rates(text, value):
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "10 GB", "1 Gib/s", "-5 GB/s", "3 parsecs"])
def test_unreadable_rates_are_refused(text):
    with pytest.raises(ValueError, match="cannot read rate"):
        parse_rate(text)


@pytest.mark.parametrize("text", ["25mbps", "3 Gbps", "10bps"])
def test_bps_is_refused_as_ambiguous(text):
    # tc reads "mbps" as megabytes per second, most tools as megabits: off by 8 either way.
    with pytest.raises(ValueError, match="ambiguous.*B/s for bytes.*bit/s for bits"):
        parse_rate(text)


def test_durations():
    assert parse_duration("5 us") == pytest.approx(5e-6)
    assert parse_duration("2ms") == pytest.approx(2e-3)
    assert parse_duration(0.25) == 0.25
    with pytest.raises(ValueError, match="cannot read duration"):
        parse_duration("5 parsecs")


def test_formats():
    assert format_size(512) == "512 B" and format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30, digits=2) == "3.00 GiB"
    assert format_rate(125e6) == "1000.0 Mbit/s"
