"""Test-only fakes (emulated torch_musa, torchada-like remap) and :func:`run_emulated` to use them.

The fakes change torch process-wide, so use them only in a fresh interpreter through
:func:`run_emulated` (from ``fakes.run_emulated`` or by file path, see that module).
"""
