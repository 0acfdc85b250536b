"""Embedded tiny models: a Llama target with P-EAGLE and EAGLE-3 draft heads.

The default build (`artifacts/tiny`) is a trained one, made by the chunked CPU plans of
`models.train_chunks` (deep16 → deep16-heads → deep16-peagle3, from a 4-layer build that
`python -m models.train_all` trained: corpus → `models.train_core` → `models.export`;
docs/tiny-model.md) and kept as is by
`python -m models.build_tiny`, which otherwise builds random weights locally and
deterministically. See `models.build_tiny` for the entry points others import
(`default_artifacts_dir`, `ensure_built`). Importing this package imports nothing
heavy (no torch, no vLLM): the modules that need torch (`torch_*`, `train_*`, `grow`)
are imported inside the functions that use them, so that `make install`'s artifact check
and the demo stay torch-free.
"""
