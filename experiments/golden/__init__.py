"""Generators of the reference files under `tests/golden/` (they need the `compare` extra:
transformers, PyTorch, kvpress). Each prints what it wrote; the tests read the files only."""
