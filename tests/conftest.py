"""Shared pytest fixtures."""

from emulation_fixture import emulated_network, require_netns  # noqa: F401
