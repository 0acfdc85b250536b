import re

import pytest

from jobs.job_report import HTML_FILE, job_report
from jobs.job_report import timeline_png

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG"
STARTED_AT = 1_700_000_000.0


def _codegen_summary(input_uri="s3://bucket/prompts/"):
    return {
        "job": "codegen", "input": input_uri, "output": "s3://bucket/out/",
        "rows_in": 30, "rows_ok": 27, "rows_error": 3, "reconciled": True,
        "errors_by_reason": {"context_length_exceeded": 3},
        "shards": {"total": 3, "committed": 3},
        "output_tokens": 4500,
        "this_run": {"elapsed_s": 90.0, "output_tokens": 4500, "output_tokens_per_s": 50.0},
        "speculation": {"method": "eagle3", "num_speculative_tokens": 3,
                        "acceptance_per_pos": [0.8, 0.55, 0.3], "mean_acceptance_length": 2.65},
    }


def _codegen_markers():
    return {
        f"part-{i}": {"shard": f"part-{i}", "rows": 10, "ok": 9, "errors": 1,
                      "committed_at": STARTED_AT + 30 * (i + 1), "output_tokens": 1500,
                      "error_reasons": {"context_length_exceeded": 1}}
        for i in range(3)
    }


def _spec_control():
    return {"engine-0": {"timeline": [[0.0, 4, 3, True], [10.0, 12, 1, True], [20.0, 2, 0, False],
                                      [30.0, 5, 3, True]]}}


def _img_sources(page: str) -> set[str]:
    return set(re.findall(r'<img src="([^"]+)"', page))


def _pngs(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name != HTML_FILE}


def test_codegen_report_names_the_job_shows_errors_and_references_exactly_its_pictures():
    files = job_report(_codegen_summary(), _codegen_markers(), started_at=STARTED_AT,
                       spec_control=_spec_control())
    page = files[HTML_FILE].decode()
    pngs = _pngs(files)

    assert "<h1>codegen</h1>" in page
    assert "s3://bucket/prompts/" in page
    assert set(pngs) == {"_report_throughput.png", "_report_acceptance.png",
                         "_report_speculation.png", "_report_errors.png"}
    assert _img_sources(page) == set(pngs)
    assert all(data.startswith(PNG_SIGNATURE) for data in pngs.values())
    assert "50.0" in page and "2.65" in page  # tokens/s and mean acceptance length in the table


def test_report_page_shows_the_run_against_the_paper_in_steady_state():
    summary = {**_codegen_summary(), "capacity": {
        "measured_steady_engine_tokens_per_s": 1267.0, "paper_tokens_per_s_with_prefill": 1142.0,
        "steady_vs_paper": 1.11, "measured_engine_startup_s": 11.9}}
    page = job_report(summary, _codegen_markers(), started_at=STARTED_AT)[HTML_FILE].decode()
    assert "steady state vs paper" in page and "1267 vs 1142" in page and "1.11x" in page
    assert "steady state" not in job_report(_codegen_summary(), _codegen_markers(),
                                            started_at=STARTED_AT)[HTML_FILE].decode()


def test_report_page_mentions_the_error_reason():
    page = job_report(_codegen_summary(), _codegen_markers(), started_at=STARTED_AT)[HTML_FILE].decode()
    assert "context_length_exceeded" in page


def test_k_in_force_picture_is_the_speculation_timeline_plot():
    files = job_report(_codegen_summary(), _codegen_markers(), started_at=STARTED_AT,
                       spec_control=_spec_control())
    assert files["_report_speculation.png"] == timeline_png(_spec_control())


def test_text_from_inputs_is_escaped():
    files = job_report(_codegen_summary("s3://b/<script>alert(1)</script>"), _codegen_markers(),
                       started_at=STARTED_AT)
    page = files[HTML_FILE].decode()
    assert "<script>" not in page
    assert "&lt;script&gt;" in page


def _tasks(num_tasks):
    return [{"task_id": f"HumanEval/{i}", "n": 10, "c": i % 11,
             "pass_at_k": {"1": (i % 11) / 10, "10": 1.0 if i % 11 else 0.0}, "statuses": {"passed": i % 11}}
            for i in range(num_tasks)]


def _score_summary():
    return {"job": "score_code", "input": "s3://bucket/out/", "output": "s3://bucket/scored/",
            "rows_in": 50, "rows_ok": 50, "rows_error": 0, "reconciled": True,
            "pass_at_k": {"1": 0.456, "10": 0.9}, "num_samples": 50, "num_passed": 23,
            "statuses": {"passed": 23, "failed": 27}}


@pytest.mark.parametrize("num_tasks", [5, 100])  # a bar per task; a histogram past ~60 tasks
def test_score_code_report_draws_pass_at_k_by_task(num_tasks):
    markers = {"part-0": {"shard": "part-0", "rows": 50, "ok": 50, "errors": 0,
                          "committed_at": STARTED_AT + 12}}
    files = job_report(_score_summary(), markers, started_at=STARTED_AT, pass_at_k=_tasks(num_tasks))
    page = files[HTML_FILE].decode()
    pngs = _pngs(files)

    assert pngs["_report_pass_at_k.png"].startswith(PNG_SIGNATURE)
    assert set(pngs) == {"_report_pass_at_k.png", "_report_throughput.png"}  # no errors: no error picture
    assert _img_sources(page) == set(pngs)
    assert "pass@1" in page and "0.456" in page


def test_minimal_summary_gives_a_page_and_no_pictures():
    files = job_report({"job": "score_logprobs", "rows_in": 0, "rows_ok": 0, "rows_error": 0}, {},
                       started_at=STARTED_AT, spec_control=None, pass_at_k=None)
    page = files[HTML_FILE].decode()

    assert set(files) == {HTML_FILE}
    assert "<h1>score_logprobs</h1>" in page
    assert "<img" not in page
