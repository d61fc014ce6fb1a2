"""Pytest fixtures for link emulation (`shardshift.netemu`).

`require_netns` skips a test, with the reason, where namespaces cannot be built (not root, no
iproute2); under CI=true it fails instead, since CI runs as root and must run these tests.
`emulated_network` is a factory, `make(rates, n)` → a started EmulatedNetwork; every network it
made is torn down after the test, whether the test passed, failed or timed out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import pytest

from shardshift.netemu.network import EmulatedNetwork, netns_unavailable_reason
from shardshift.netemu.processes import cleanup_stale


@pytest.fixture(scope="session")
def require_netns() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set, so link-emulation tests must run, but: {reason}")
        pytest.skip(reason)
    cleanup_stale()  # namespaces of earlier runs that were killed before tearing down


@pytest.fixture
def emulated_network(require_netns) -> Iterator[Callable[..., EmulatedNetwork]]:
    made: list[EmulatedNetwork] = []

    def make(rates: Mapping[tuple[int, int], float], n: int, **kwargs) -> EmulatedNetwork:
        net = EmulatedNetwork(rates, n, **kwargs)
        made.append(net)
        net.start()
        return net

    yield make
    errors = []
    for net in made:
        try:
            net.close()
        except RuntimeError as err:
            errors.append(str(err))
    if errors:
        pytest.fail("; ".join(errors))
