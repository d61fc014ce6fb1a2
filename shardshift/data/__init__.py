"""Data shipped with the package: the default training text (README.md says what it is)."""
