"""The documented way to run the main job: `ray job submit` against a local Ray cluster."""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_submits_codegen_with_ray_job_submit_and_reports_summary(repo_root, tiny_models):
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.demo", "--limit", "8", "--shards", "2", "sampling.max_tokens=16"],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ray job submit --working-dir . -- python -m jobs.codegen" in proc.stdout
    assert "rows in 8 | ok 8 | errors 0 | reconciled True" in proc.stdout
    assert "mean acceptance length" in proc.stdout
    assert "pass@1" in proc.stdout and "python -m jobs.score_code" in proc.stdout
    # What speculation bought, measured on the same cluster, and the proof it changed no text.
    assert "python -m jobs.spec_gain" in proc.stdout
    gain = next(line for line in proc.stdout.splitlines() if line.startswith("speculation at concurrency 1"))
    # The preset's controller is on: the line names the K it put in force for one request.
    assert re.search(r"\(peagle controller chose K=[0-4] of 0\.\.4[,)]", gain), gain
    assert "output tok/s without" in gain and "greedy outputs identical" in gain
    # It stopped what it started: no Ray cluster of its own is left behind.
    leftover = subprocess.run(["pgrep", "-f", "peagle-ray-"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_speculation_gain_refuses_a_preset_without_speculation(repo_root):
    proc = subprocess.run([sys.executable, "-m", "jobs.spec_gain", "engine.spec={method: none}"],
                          cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "engine.spec.method='none'" in proc.stderr and "Traceback" not in proc.stderr
