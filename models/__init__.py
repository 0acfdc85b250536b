"""Embedded tiny models: a Llama target with P-EAGLE and EAGLE-3 draft heads.

Built locally and deterministically by `python -m models.build_tiny`; see
`models.build_tiny` for the entry points others import (`default_artifacts_dir`,
`ensure_built`). Importing this package imports nothing heavy (no torch, no vLLM).
"""
