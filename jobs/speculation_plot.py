"""The speculation controller's timeline as a picture: per engine, the requests running
and the K in force over the job, one panel per engine (at most `MAX_PANELS`). Written
next to a job's `_summary.json` as `_speculation.png` when the engines ran a controller.

Reads the controller states the job collected (`actors.spec_control` `state()`, its
`timeline` of [seconds since the engine started, running requests, K in force,
speculating]); spells where the engine ran without its drafter (restarted plain) are
shaded. Knows nothing about engines or storage.
"""

from __future__ import annotations

import io
from typing import Any

MAX_PANELS = 8
FILE_NAME = "_speculation.png"


def timeline_png(per_engine: dict[str, dict[str, Any]]) -> bytes | None:
    """PNG bytes, or None when no engine recorded a timeline."""
    engines = [(key, c["timeline"]) for key, c in sorted(per_engine.items()) if c.get("timeline")]
    if not engines:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = engines[:MAX_PANELS]
    fig, axes = plt.subplots(len(engines), 1, figsize=(8, 2.6 * len(engines)), sharex=True, squeeze=False)
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
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
