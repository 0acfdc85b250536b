"""benchmarks.serve_overhead's summary over rounds, on stated figures: a server's figures are
medians over rounds, a ratio is the median of each round's own ratio, and a failed request in
any round shows."""

from benchmarks.serve_overhead import median_over_rounds, ratios, render


def _load(tok_s: float, p99: float, failed: int = 0) -> dict:
    return {"output_tok_s": tok_s, "ttft_mean_ms": p99 / 2, "ttft_p99_ms": p99, "tpot_mean_ms": 5.0,
            "server_cpu_ms_per_token": 1.0, "duration_s": 10.0, "failed": failed}


# The machine runs fast in round 2 and slow in round 3: every server of a round alike.
ROUNDS = [
    {"project-direct": {"c16": _load(1000, 300)}, "vllm-serve-inproc": {"c16": _load(1000, 250)}},
    {"project-direct": {"c16": _load(1900, 200)}, "vllm-serve-inproc": {"c16": _load(2000, 200)}},
    {"project-direct": {"c16": _load(450, 400, failed=1)}, "vllm-serve-inproc": {"c16": _load(500, 400)}},
]


def test_a_ratio_is_the_median_of_each_rounds_own_ratio():
    # per round 1.0, 0.95, 0.9 -> 0.95; the ratio of the medians (1000 / 1000) would say 1.0
    assert ratios(ROUNDS, "project-direct", "vllm-serve-inproc", "output_tok_s")["c16"] == 0.95
    assert ratios(ROUNDS, "project-direct", "vllm-serve-inproc", "ttft_p99_ms")["c16"] == 1.0


def test_a_load_no_round_ran_for_both_servers_has_no_ratio():
    r = ratios(ROUNDS, "project-direct", "vllm-serve-inproc", "output_tok_s")
    assert r["c1"] is None and r["unlimited"] is None
    assert ratios(ROUNDS, "project-direct", "ray-serve-llm", "output_tok_s")["c16"] is None


def test_servers_figures_are_medians_and_failures_add_up():
    merged = median_over_rounds(ROUNDS)
    c16 = merged["project-direct"]["c16"]
    assert c16["output_tok_s"] == 1000 and c16["ttft_p99_ms"] == 300
    assert c16["failed"] == 1  # one failed request in round 3 is not hidden by the median
    assert [r["output_tok_s"] for r in c16["rounds"]] == [1000, 1900, 450]
    table = render({"servers": merged, "ratios": {"project-direct / vllm-serve-inproc": ratios(
        ROUNDS, "project-direct", "vllm-serve-inproc", "output_tok_s")}})
    assert "| project-direct | c16 | 1000 | 150.0 | 300 | 1 |" in table
    assert "| project-direct / vllm-serve-inproc | - | - | 0.95 | - |" in table
    assert "ratio (TTFT p99)" not in table  # no section for ratios the report lacks
