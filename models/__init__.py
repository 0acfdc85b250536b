"""Embedded tiny models: a Llama target with P-EAGLE and EAGLE-3 draft heads.

The default build (`artifacts/tiny`) is a trained one, made by `python -m
models.train_all` (corpus → `models.train_core` → `models.export`) and kept as is by
`python -m models.build_tiny`, which otherwise builds random weights locally and
deterministically. See `models.build_tiny` for the entry points others import
(`default_artifacts_dir`, `ensure_built`). Importing this package imports nothing
heavy (no torch, no vLLM).
"""
