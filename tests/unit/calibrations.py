"""Calibrations the unit tests decide from, kept apart from the shipped ones so that
re-measuring `configs/calibration/cpu-tiny.json` on a machine never changes a test's outcome.

`DRAFTER_PASS`: the tiny preset as measured on 2026-11-30, before a K=0 step skipped the
drafter (actors/k0_skip.py): its K=0 step still pays the drafter's first pass, so a plain
engine is about twice as fast at K=0 (`k0_draft_fixed_s` ~4.3 ms). The restart-without-the-
drafter decisions are about exactly such an engine (a GPU drafter holding memory, or an
engine where the skip plugin cannot load)."""

from pathlib import Path

DRAFTER_PASS = Path(__file__).resolve().parent / "data" / "cpu-tiny-drafter-pass.json"
