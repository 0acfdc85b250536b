"""Speculation controller: pick K per batch size from measured acceptance and step times,
and size the replica pool on capacity at that K. Pure: standard library, numpy and the
config types of `configs` (no Ray, vLLM or torch), so it is unit-tested with plain numbers
and simulated offline (`benchmarks.sim`).

Modules: model (τ(K), T(B, K), KV limit), acceptance (online per-position estimate),
capacity (replicas at a latency target), policy (the controller), step_time (measured
corrections), replacement (restart without the drafter), calibration (the file format;
the fits are `tools.fit_calibration`), live (the loop inside each engine), plan (the
config resolved once: resources, engines, the capacity estimate for a job's rows).
"""
