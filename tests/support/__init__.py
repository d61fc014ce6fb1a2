"""Helpers shared by the tests: real process groups (`dist`), an in-process group (`local_group`),
emulated networks (`netns`), training runs to compare (`training`), and where things are."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository's root: commands run from there
DOCS = REPO / "docs"
# The README's model of one's own (a plain nn.Module and its ModuleSpec), as --model names it.
EXAMPLE_MODEL = f"{REPO / 'examples' / 'tiny_decoder.py'}:spec"
