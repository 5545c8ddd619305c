"""Test kit for backend authors: a pytest plugin (``--magi-backend``) and a conformance suite."""
