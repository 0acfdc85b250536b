"""Synthetic acceptance on the real vLLM engine (CPU, tiny model, P-EAGLE head, K=4).

`engine.spec.synthetic_acceptance_rates` needs the CPU synthetic sampler
(actors/synthetic_rejection.py, a vLLM general plugin): without it the engine core dies
on its first verify step. Measured per-position acceptance comes from vLLM's own
per-step spec-decode stats (`Engine.stats`).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from actors.engine import Engine
from actors.spec_stats import SpecDecodeStats
from configs import load_config
from control.plan import startup_engine

pytestmark = pytest.mark.integration

RATES = [0.8, 0.6, 0.4, 0.2]
LOW_RATES = [0.3, 0.1, 0.05, 0.0]
SPEC_OFF = "engine.spec={method: none}"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def add(a, b):\n    return",
    "squares = [i * i for i in range(",
    "if __name__ == '__main__':\n",
    "def read_file(path):\n",
]
# Each verify step draws fresh uniforms, so whether position i is accepted in a draft is
# an independent Bernoulli(p_i) trial (p_i the unconditional rate) and the measured
# acceptance accepted_i / num_drafts has standard deviation sqrt(p_i (1 - p_i) / num_drafts).
# Allowing 4.5 of them: >= 2000 drafts give at most +-0.05; a false alarm over the ten
# checks below is < 1e-4, while a sampler that ignored the rates (the head's real
# acceptance, accept-all, or the rates shifted by one position) misses by 0.1 or more.
NUM_SIGMAS = 4.5
MIN_CALIBRATION_DRAFTS = 2000


def _generate(overrides: list[str], requests: list[dict]) -> tuple[dict[str, dict], SpecDecodeStats]:
    cfg = load_config("tiny", ["engine.spec.controller=off", *overrides])  # K=4 throughout
    engine = Engine(startup_engine(cfg.engine), cfg.sampling)

    async def run_all():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    try:
        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    assert all(r["ok"] for r in results), [r.get("error") for r in results if not r["ok"]]
    return {r["id"]: r for r in results}, engine.stats


def _requests(num: int, max_tokens: int, temperature: float = 0.0) -> list[dict]:
    return [{"id": f"t{temperature}-{i}", "prompt": PROMPTS[i % len(PROMPTS)] + f"# {i}\n",
             "max_tokens": max_tokens, "temperature": temperature} for i in range(num)]


def _rates_override(rates: list[float]) -> str:
    return f"engine.spec.synthetic_acceptance_rates={rates}"


def _assert_calibrated(stats: SpecDecodeStats, rates: list[float]) -> None:
    measured = stats.acceptance_per_pos
    for pos, (want, got) in enumerate(zip(rates, measured, strict=True)):
        tolerance = NUM_SIGMAS * math.sqrt(want * (1 - want) / stats.num_drafts)
        assert abs(got - want) <= tolerance, (
            f"position {pos + 1}: measured {got:.4f}, configured {want} "
            f"(+-{tolerance:.4f} over {stats.num_drafts} drafts); all measured {measured}")
    # Accepted per draft A = sum of the position indicators; position j is accepted only
    # if every earlier one is, so E[A^2] = sum_j p_j (2j + 1) (j from 0).
    mean = sum(rates)
    variance = sum(p * (2 * j + 1) for j, p in enumerate(rates)) - mean**2
    tolerance = NUM_SIGMAS * math.sqrt(variance / stats.num_drafts)
    assert stats.mean_acceptance_length == pytest.approx(1 + mean, abs=tolerance)


@pytest.fixture(scope="module")
def calibrated(tiny_models) -> SpecDecodeStats:
    """RATES, one batch mixing greedy and temperature-1 requests (vLLM verifies them in
    different kernels, so both replacements run in the same steps)."""
    requests = _requests(16, 256) + _requests(16, 256, temperature=1.0)
    _, stats = _generate([_rates_override(RATES)], requests)
    return stats


def test_measured_acceptance_matches_configured_rates(calibrated):
    assert calibrated.num_drafts >= MIN_CALIBRATION_DRAFTS
    _assert_calibrated(calibrated, RATES)


def test_other_rates_give_other_acceptance(tiny_models, calibrated):
    _, low = _generate([_rates_override(LOW_RATES)], _requests(32, 48, temperature=1.0))
    assert low.num_drafts >= 500
    _assert_calibrated(low, LOW_RATES)
    # A zero rate is exact: no draft ever gets past position 3.
    assert low.num_accepted_tokens_per_pos[3] == 0
    assert low.mean_acceptance_length < calibrated.mean_acceptance_length - 1.0


def test_engine_without_synthetic_rates_verifies_for_real(tiny_models):
    """The plugin is loaded in every engine; without synthetic rates the head's own
    acceptance is measured and greedy output stays the target model's, token for token."""
    requests = _requests(2, 48)
    baseline, _ = _generate([SPEC_OFF], requests)
    speculative, stats = _generate([], requests)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert {i: r["token_ids"] for i, r in speculative.items()} == {
        i: r["token_ids"] for i, r in baseline.items()}


def test_install_is_idempotent_and_leaves_standard_verification_to_vllm():
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    from actors.synthetic_rejection import install

    install()
    greedy = cpu_tl._rejection_greedy_sample_kernel_impl
    random = cpu_tl._rejection_random_sample_kernel_impl
    install()
    assert (cpu_tl._rejection_greedy_sample_kernel_impl, cpu_tl._rejection_random_sample_kernel_impl) == (
        greedy, random)
    # Standard mode goes to vLLM's C++ kernel: accept while the draft is the target argmax.
    current_platform.import_kernels()
    out = torch.full((2, 4), -1, dtype=torch.int32)
    greedy(out, torch.tensor([3, 6], dtype=torch.int32), torch.tensor([5, 6, 7, 5, 6, 7], dtype=torch.int32),
           torch.tensor([5, 6, 8, 5, 6, 7]), torch.tensor([[42], [43]]), None, 3)
    assert out.tolist() == [[5, 6, 8, -1], [5, 6, 7, 43]]


def test_install_does_nothing_off_cpu(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    from actors.synthetic_rejection import install

    def vllm_wrapper(*args):
        raise AssertionError("not called")

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(cpu_tl, "_rejection_greedy_sample_kernel_impl", vllm_wrapper)
    install()
    assert cpu_tl._rejection_greedy_sample_kernel_impl is vllm_wrapper
