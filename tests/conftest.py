"""Shared pytest fixtures."""

from emulation_fixture import emulated_network, require_netns  # noqa: F401


# Hypothesis: no per-example deadline (two shared cores make timings noisy), a fixed example count.
try:
    from hypothesis import settings as _settings

    _settings.register_profile("shardshift", deadline=None, max_examples=50)
    _settings.load_profile("shardshift")
except ImportError:  # only tests that use hypothesis need it; they import it themselves
    pass
