"""Per-replica Prometheus metrics through Ray's metrics system.

Each replica exports its engine's spec-decode counters and load signals tagged with its
replica id, so a Prometheus scraping Ray's metrics endpoints sees every replica
separately (vLLM's own /metrics route reaches whichever replica the proxy picks).
Reads `SpecDecodeStats` dicts only; knows nothing about vLLM.
"""

from __future__ import annotations

from typing import Any

COUNTERS = {
    "num_drafts": "Spec-decode draft-verify steps",
    "num_draft_tokens": "Draft tokens proposed",
    "num_accepted_tokens": "Draft tokens accepted",
    "num_output_tokens": "Output tokens generated",
    "num_prompt_tokens": "Prompt tokens processed",
}


def k_at_batch_sizes(schedule: list[list[int]]) -> list[tuple[int, int]]:
    """K at batch sizes 1, 2, 4, ... up to the table's end, from [[lo, hi, K], ...] rows:
    a fixed set of label values, whatever ranges the table has."""
    if not schedule:
        return []
    top = max(hi for _, hi, _ in schedule)
    out, b = [], 1
    while b <= top:
        out.append((b, next((k for lo, hi, k in schedule if lo <= b <= hi), schedule[-1][2])))
        b *= 2
    if out[-1][0] != top:
        out.append((top, next(k for lo, hi, k in schedule if lo <= top <= hi)))
    return out


class ReplicaMetrics:
    def __init__(self, replica_id: str):
        from ray.util import metrics

        self.tags = {"replica": replica_id}
        self.counters = {
            name: metrics.Counter(f"peagle_spec_decode_{name}", description=desc, tag_keys=("replica",))
            for name, desc in COUNTERS.items()
        }
        self.acceptance_length = metrics.Gauge(
            "peagle_spec_decode_mean_acceptance_length",
            description="1 + accepted / drafts (counts the bonus token)", tag_keys=("replica",))
        self.accepted_per_pos = metrics.Counter(
            "peagle_spec_decode_num_accepted_tokens_per_pos",
            description="Accepted draft tokens at each draft position", tag_keys=("replica", "position"))
        self.acceptance_per_pos = metrics.Gauge(
            "peagle_spec_decode_acceptance_per_pos",
            description="Unconditional acceptance at each draft position (accepted / drafts)",
            tag_keys=("replica", "position"))
        self.gauges = {
            name: metrics.Gauge(f"peagle_engine_{name}", description=name, tag_keys=("replica",))
            for name in ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "batch_in_flight")
        }
        self.k_in_force = metrics.Gauge(
            "peagle_spec_k_in_force", description="K the speculation controller runs at the current batch size",
            tag_keys=("replica",))
        self.k_changes = metrics.Counter(
            "peagle_spec_k_table_changes", description="Times the controller put a new batch-size -> K table "
            "in force (reasons in the replica log and /stats)", tag_keys=("replica",))
        self.capacity = metrics.Gauge(
            "peagle_spec_capacity_tokens_per_s", description="Output tokens/s the replica predicts it "
            "delivers at the latency target with the K table in force", tag_keys=("replica",))
        self.k_at_batch_size = metrics.Gauge(
            "peagle_spec_k_at_batch_size", description="K at a batch size: in the table on the engine now "
            "(table=in_force: the decided table, or a one-interval probe) or in the controller's decided "
            "table (table=decided)", tag_keys=("replica", "batch_size", "table"))
        self.off_advised = metrics.Gauge(
            "peagle_spec_drafting_off_advised", description="1 while drafting is off at every batch size: a "
            "replica started without speculation would serve this load faster (advice in /speculation)",
            tag_keys=("replica",))
        self._last: dict[str, Any] = {}

    def update(self, stats: dict[str, Any], batch_in_flight: int) -> None:
        for name, counter in self.counters.items():
            delta = stats.get(name, 0) - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta, tags=self.tags)
        last_pos = self._last.get("num_accepted_tokens_per_pos", [])
        for i, n in enumerate(stats.get("num_accepted_tokens_per_pos", [])):
            delta = n - (last_pos[i] if i < len(last_pos) else 0)
            if delta > 0:
                self.accepted_per_pos.inc(delta, tags={**self.tags, "position": str(i + 1)})
        for i, rate in enumerate(stats.get("acceptance_per_pos", [])):
            self.acceptance_per_pos.set(rate, tags={**self.tags, "position": str(i + 1)})
        if stats.get("mean_acceptance_length") is not None:
            self.acceptance_length.set(stats["mean_acceptance_length"], tags=self.tags)
        signals = {**stats.get("signals", {}), "batch_in_flight": batch_in_flight}
        for name, gauge in self.gauges.items():
            if signals.get(name) is not None:
                gauge.set(signals[name], tags=self.tags)
        control = stats.get("spec_control")
        if control:
            self.k_in_force.set(control["k_in_force"], tags=self.tags)
            delta = control["changes"] - ((self._last.get("spec_control") or {}).get("changes", 0))
            if delta > 0:
                self.k_changes.inc(delta, tags=self.tags)
            if control.get("capacity"):
                self.capacity.set(control["capacity"]["tokens_per_s"], tags=self.tags)
            self.off_advised.set(1.0 if control.get("advice") else 0.0, tags=self.tags)
            for table in ("schedule", "table"):
                for b, k in k_at_batch_sizes(control.get(table) or []):
                    self.k_at_batch_size.set(k, tags={**self.tags, "batch_size": str(b),
                                                      "table": "in_force" if table == "schedule" else "decided"})
        self._last = stats
