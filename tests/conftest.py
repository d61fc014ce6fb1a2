"""Markers, time budgets and fixtures shared by every test.

The folder a test lives in says what it starts, and its marker follows from it:

- ``tests/unit``: nothing but the test process (threads at most);
- ``tests/dist``: real processes joined in gloo groups, or `shardshift` commands (``multiproc``);
- ``tests/netns``: processes in emulated networks, which need root (``netns`` and ``multiproc``).

Budgets. pytest-timeout stops a test after its limit (`timeout` in pyproject.toml, or a test's
own ``@pytest.mark.timeout(S)``). A test that starts processes gives every wait the time its
`budget` has left: the limit less `MARGIN_S`, counted from the test's start. The harness then
fails first, with its own message, and kills what it started, instead of being cut off with
processes left behind.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from support.netns import emulated_network, require_netns  # noqa: F401  (fixtures)

MARGIN_S = 30.0
_MARKERS = {"dist": ("multiproc",), "netns": ("multiproc", "netns")}
_TESTS = Path(__file__).resolve().parent

# Hypothesis: no per-example deadline (two shared cores make timings noisy), a fixed example count.
try:
    from hypothesis import settings as _settings

    _settings.register_profile("shardshift", deadline=None, max_examples=50)
    _settings.load_profile("shardshift")
except ImportError:  # only tests that use hypothesis need it; they import it themselves
    pass


def pytest_collection_modifyitems(config, items) -> None:
    folders = set()
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(_TESTS).parts[0]
        folders.add(folder)
        for name in _MARKERS.get(folder, ()):
            item.add_marker(name)
    # A whole-suite run must reach every folder: a folder pytest skips (it skips any named "dist"
    # unless told otherwise) would pass silently.
    if any(Path(arg).resolve() == _TESTS for arg in config.args) and not config.option.keyword:
        missing = {"unit", "dist", "netns"} - folders
        if missing:
            raise pytest.UsageError(f"no test was collected from tests/{', tests/'.join(sorted(missing))}")


def time_limit(node, config) -> float:
    """The pytest-timeout limit of a test, in seconds."""
    marker = node.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None else float(config.getini("timeout"))


@pytest.fixture(autouse=True)
def _no_temp_dir_left(request):
    """A test that starts processes must not leave a launcher's directory (store, logs) behind."""
    if request.node.get_closest_marker("multiproc") is None:
        yield
        return
    before = set(Path(tempfile.gettempdir()).glob("shardshift-*"))
    yield
    left = set(Path(tempfile.gettempdir()).glob("shardshift-*")) - before
    assert not left, f"left behind: {sorted(map(str, left))}"


class Budget:
    """The time a test may give the processes it starts, counted from its start."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (at least 1, so that a late wait still fails with its own message)."""
        return max(1.0, self.end - time.monotonic())


@pytest.fixture
def budget(request) -> Budget:
    """The test's time limit less `MARGIN_S` (see the module docstring)."""
    return Budget(time_limit(request.node, request.config) - MARGIN_S)
