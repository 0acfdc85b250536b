"""Speculation controller: pick K per batch size from measured acceptance and step times,
and size the replica pool on capacity at that K. Pure: standard library, numpy and the
config types of `configs` (no Ray, vLLM or torch), so it is unit-tested with plain numbers
and simulated offline.

Modules: model (τ(K), T(B, K), KV limit), acceptance (online per-position estimate),
capacity (replicas at a latency target), policy (the controller), calibration (JSON files
and fits), simulator (discrete-event replica pool), baselines (policies compared), plan (a config's
resource plan: actors, what each holds, and the capacity estimate for a job's rows).
"""
