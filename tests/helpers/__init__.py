"""Test helpers shared by the magi-core test suite (not part of the installed package)."""
