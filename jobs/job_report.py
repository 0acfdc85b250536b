"""A batch job's report for a person: one HTML page (`_report.html`) and the PNGs it shows
(`_report_*.png`), written next to the job's `_summary.json`.

Owns what is drawn and how the page reads: throughput over the run, speculation acceptance
by draft position, the K in force over time (`timeline_png`), errors by reason, and
score_code's pass@k by task. Each picture is drawn only when its data is
there. Takes plain dicts (the summary, this run's shard markers, the controller states, the
per-task pass@k rows) and returns file contents; knows nothing about engines or Ray.
`write_report` writes them through the job's output store and never fails a finished job.
"""

from __future__ import annotations

import html
import io
import logging
from typing import Any

log = logging.getLogger(__name__)

HTML_FILE = "_report.html"
TIMELINE_FILE = "_report_speculation.png"
MAX_TIMELINE_PANELS = 8
MAX_TASK_BARS = 60  # beyond this many tasks, a bar per task is unreadable: histogram instead


def job_report(summary: dict, markers: dict[str, dict], *, started_at: float,
               spec_control: dict[str, dict] | None = None,
               pass_at_k: list[dict] | None = None) -> dict[str, bytes]:
    """File name -> contents: `_report.html` and the PNGs it shows (`_report_*.png`)."""
    pictures = [  # (name, caption, png or None)
        ("throughput", *_throughput(summary, markers, started_at)),
        ("acceptance", *_acceptance(summary.get("speculation") or {})),
        ("speculation", "Per engine: running requests and the K in force over time "
                        "(shaded: engine running without its drafter).", timeline_png(spec_control or {})),
        ("errors", *_errors(summary)),
        ("pass_at_k", *_pass_at_k(summary, pass_at_k or [])),
    ]
    files = {f"_report_{name}.png": png for name, _, png in pictures if png is not None}
    figures = [(f"_report_{name}.png", caption) for name, caption, png in pictures if png is not None]
    return {HTML_FILE: _page(summary, figures).encode(), **files}


def write_report(store, summary: dict, markers: dict[str, dict], started_at: float, **kwargs: Any) -> set[str]:
    """Write the report next to the summary and name it there (`summary["report"]`);
    returns the names of the files written. A picture that cannot be drawn is logged: the
    job's results are committed already."""
    try:
        files = job_report(summary, markers, started_at=started_at, **kwargs)
    except Exception as exc:  # a report is a view of the summary; never lose a finished job to it
        log.warning("job report not written: %s: %s", type(exc).__name__, exc)
        return set()
    for name, data in files.items():
        store.write_bytes(name, data)
    summary["report"] = store.uri_of(HTML_FILE)
    return set(files)


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _page(summary: dict, figures: list[tuple[str, str]]) -> str:
    job = summary.get("job", "job")
    run = summary.get("this_run") or {}
    shards = summary.get("shards") or {}
    rows = [("rows in", summary.get("rows_in")), ("rows ok", summary.get("rows_ok")),
            ("rows with errors", summary.get("rows_error"))]
    if "reconciled" in summary:
        rows.append(("reconciled", "yes" if summary["reconciled"] else "NO"))
    if shards:
        rows.append(("shards committed", f"{shards.get('committed', '?')} of {shards.get('total', '?')}"))
    if run.get("elapsed_s") is not None:
        rows.append(("elapsed this run", f"{run['elapsed_s']} s"))
    if summary.get("output_tokens") is not None:
        rows.append(("output tokens", summary["output_tokens"]))
    if run.get("output_tokens_per_s") is not None:
        rows.append(("output tokens/s this run", run["output_tokens_per_s"]))
    capacity = summary.get("capacity") or {}
    if capacity.get("steady_vs_paper") is not None:
        rows.append(("steady state vs paper", f"{capacity['measured_steady_engine_tokens_per_s']:.0f} vs "
                     f"{capacity['paper_tokens_per_s_with_prefill']:.0f} tok/s per engine "
                     f"({capacity['steady_vs_paper']:.2f}x; engine start-up {capacity.get('measured_engine_startup_s')} s)"))
    spec = summary.get("speculation") or {}
    if spec.get("method"):
        rows.append(("speculation", f"{spec['method']}, K={spec.get('num_speculative_tokens')}"))
    if isinstance(spec.get("mean_acceptance_length"), (int, float)):
        rows.append(("mean acceptance length", f"{spec['mean_acceptance_length']:.2f}"))
    for k, value in sorted((summary.get("pass_at_k") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"pass@{k}", f"{value:.3f}" if isinstance(value, (int, float)) else value))
    table = "\n".join(f"<tr><th>{_esc(name)}</th><td>{_esc(value)}</td></tr>" for name, value in rows)
    images = "\n".join(f'<figure><img src="{_esc(name)}" alt="{_esc(caption)}">'
                       f"<figcaption>{_esc(caption)}</figcaption></figure>" for name, caption in figures)
    where = f"{summary.get('input', '?')} → {summary.get('output', '?')}"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_esc(job)} report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}} th{{text-align:left;padding-right:2em}}
figure{{margin:2em 0}} img{{max-width:100%}} figcaption{{color:#555}}</style></head>
<body><h1>{_esc(job)}</h1>
<p>{_esc(where)}</p>
<table>
{table}
</table>
{images}
</body></html>
"""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(width_in: float = 8, height_in: float = 3.5):
    return _pyplot().subplots(figsize=(width_in, height_in))


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _throughput(summary: dict, markers: dict[str, dict], started_at: float) -> tuple[str, bytes | None]:
    commits = sorted((m for m in markers.values() if m.get("committed_at") is not None),
                     key=lambda m: m["committed_at"])
    if not commits:
        return "", None
    tokens = all(m.get("output_tokens") is not None for m in commits)
    unit, key = ("output tokens", "output_tokens") if tokens else ("rows", "rows")
    minutes = [0.0] + [(m["committed_at"] - started_at) / 60 for m in commits]
    totals = [0]
    for m in commits:
        totals.append(totals[-1] + (m.get(key) or 0))
    elapsed_s = (summary.get("this_run") or {}).get("elapsed_s") or (commits[-1]["committed_at"] - started_at)
    rate = f"{totals[-1] / elapsed_s:,.1f} {unit}/s on average" if elapsed_s > 0 else "no elapsed time"
    fig, ax = _figure()
    ax.step(minutes, totals, where="post", marker=".")
    ax.set_xlabel("minutes since this run started")
    ax.set_ylabel(f"{unit} committed")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput: {rate}")
    return f"Cumulative {unit} committed this run, one step per shard commit.", _png(fig)


def _acceptance(spec: dict) -> tuple[str, bytes | None]:
    per_pos = spec.get("acceptance_per_pos") or []
    if not per_pos:
        return "", None
    fig, ax = _figure(6, 3.5)
    positions = list(range(1, len(per_pos) + 1))
    ax.bar(positions, per_pos, color="tab:green")
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted")
    ax.set_ylim(0, 1)
    length = spec.get("mean_acceptance_length")
    ax.set_title(f"Acceptance by position ({spec.get('method', 'speculation')}); mean acceptance length "
                 + (f"{length:.2f}" if isinstance(length, (int, float)) else "unknown"))
    return ("Fraction of drafts whose token at each position was accepted "
            "(a token counts only if all before it were)."), _png(fig)


def _errors(summary: dict) -> tuple[str, bytes | None]:
    counts = {reason: num for reason, num in (summary.get("errors_by_reason") or {}).items() if num}
    if not counts:
        return "", None
    ordered = sorted(counts.items(), key=lambda kv: kv[1])  # largest at the top
    fig, ax = _figure(8, max(2.0, 1 + 0.4 * len(ordered)))
    ax.barh([r for r, _ in ordered], [n for _, n in ordered], color="tab:red")
    ax.set_xlabel("rows")
    ax.set_title(f"Errors by reason ({sum(counts.values())} rows)")
    listed = ", ".join(f"{reason} ({num})" for reason, num in reversed(ordered))
    return f"Rows in the job's error output, by reason: {listed}.", _png(fig)


def _pass_at_k(summary: dict, tasks: list[dict]) -> tuple[str, bytes | None]:
    ks = sorted({int(k) for t in tasks for k in (t.get("pass_at_k") or {})})
    if not ks:
        return "", None
    k = str(ks[0])
    scored = [(str(t.get("task_id", "?")), t["pass_at_k"][k]) for t in tasks if k in (t.get("pass_at_k") or {})]
    overall = (summary.get("pass_at_k") or {}).get(k)
    title = f"pass@{k} by task" + (f": overall {overall:.3f}" if isinstance(overall, (int, float)) else "")
    if len(scored) > MAX_TASK_BARS:
        fig, ax = _figure()
        ax.hist([p for _, p in scored], bins=20, range=(0, 1), color="tab:blue")
        ax.set_xlabel(f"pass@{k} of a task")
        ax.set_ylabel("tasks")
        caption = f"How many of the {len(scored)} tasks reached each pass@{k}."
    else:
        fig, ax = _figure(max(6, 0.25 * len(scored)), 4)
        ax.bar(range(len(scored)), [p for _, p in scored], color="tab:blue")
        ax.set_xticks(range(len(scored)), [name for name, _ in scored], rotation=90, fontsize=7)
        ax.set_ylabel(f"pass@{k}")
        ax.set_ylim(0, 1)
        caption = f"pass@{k} of each task, in the order scored."
    ax.set_title(title)
    return caption, _png(fig)


def timeline_png(per_engine: dict[str, dict[str, Any]]) -> bytes | None:
    """The speculation controllers' timeline: per engine (at most `MAX_TIMELINE_PANELS`),
    the requests running and the K in force over the job, from the `timeline` of each
    controller state (`control.live`: [seconds since the engine started, running
    requests, K in force, speculating]); spells without the drafter are shaded. PNG bytes,
    or None when no engine recorded a timeline."""
    engines = [(key, c["timeline"]) for key, c in sorted(per_engine.items()) if c.get("timeline")]
    if not engines:
        return None
    engines = engines[:MAX_TIMELINE_PANELS]
    fig, axes = _pyplot().subplots(len(engines), 1, figsize=(8, 2.6 * len(engines)), sharex=True, squeeze=False)
    for ax, (key, timeline) in zip(axes[:, 0], engines):
        t = [p[0] for p in timeline]
        ax.step(t, [p[1] for p in timeline], where="post", color="tab:blue", label="running requests")
        ax.set_ylabel("running requests", color="tab:blue")
        ax.set_ylim(bottom=0)
        k_ax = ax.twinx()
        k_ax.step(t, [p[2] for p in timeline], where="post", color="tab:red", label="K in force")
        k_ax.set_ylabel("K in force", color="tab:red")
        k_ax.set_ylim(-0.3, max(max(p[2] for p in timeline), 1) + 0.5)
        plain = [(a[0], b[0]) for a, b in zip(timeline, timeline[1:] + [timeline[-1]])
                 if len(a) > 3 and not a[3]]
        for i, (lo, hi) in enumerate(plain):
            ax.axvspan(lo, hi, color="0.85", lw=0, label="engine without drafter" if i == 0 else None)
        if plain:
            ax.legend(loc="upper left", fontsize=7)
        ax.set_title(f"engine {key}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the engine started")
    fig.suptitle("Speculation controller: load and K in force")
    return _png(fig)
