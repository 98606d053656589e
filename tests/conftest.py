"""The core suite's fixtures: pdhal.testing.fixtures' namespace per test (nothing may be left
in /dev/shm) with a fresh backend selection."""

from pdhal.testing.fixtures import namespace  # noqa: F401  (autouse: every test)
