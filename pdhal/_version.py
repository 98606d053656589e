"""The version of the pdhal distribution (pyproject.toml says the same)."""

__version__ = "0.1.0"
