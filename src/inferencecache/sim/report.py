"""Results of ``demo`` and ``simulate``: one JSON shape, a rich table, a PNG and the targets.

The JSON document is exactly::

    {"workload": "<name>",
     "policies": {"<policy>": {"hit_rate": float, "ttft_p50_ms": float, "ttft_p90_ms": float,
                               "requests": int, "hint_overhead_p50_ms": float}}}

``hit_rate`` is prefix-cache hit tokens / queried tokens as the engines count them; the hint
overhead is the time spent obtaining the policy's signal per request (LookupRoute for
``cache_aware``, the engines' cache queries for ``oracle``, 0 for the others).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from rich.table import Table

FIELDS: Final = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "requests", "hint_overhead_p50_ms")

Summary = Mapping[str, float | int]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (numpy's default "linear"); 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(
    hit_rate: float, ttft_s: Sequence[float], hint_s: Sequence[float], requests: int
) -> dict[str, float | int]:
    """One policy's row of the document (times in seconds in, milliseconds out)."""
    return {
        "hit_rate": round(hit_rate, 6),
        "ttft_p50_ms": round(percentile(ttft_s, 50) * 1000, 3),
        "ttft_p90_ms": round(percentile(ttft_s, 90) * 1000, 3),
        "requests": requests,
        "hint_overhead_p50_ms": round(percentile(hint_s, 50) * 1000, 4),
    }


def document(workload: str, policies: Mapping[str, Summary]) -> dict[str, Any]:
    """The JSON document (policies in the order given)."""
    out: dict[str, dict[str, float | int]] = {}
    for name, s in policies.items():
        out[name] = {
            "hit_rate": float(s["hit_rate"]),
            "ttft_p50_ms": float(s["ttft_p50_ms"]),
            "ttft_p90_ms": float(s["ttft_p90_ms"]),
            "requests": int(s["requests"]),
            "hint_overhead_p50_ms": float(s["hint_overhead_p50_ms"]),
        }
    return {"workload": workload, "policies": out}


def write_json(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return p


def _ratio(a: float, b: float) -> str:
    if b <= 0:
        return "-"
    return f"{a / b:.2f}x"


def table(doc: Mapping[str, Any], title: str) -> Table:
    """The rich table of one document: one row per policy."""
    pols: Mapping[str, Summary] = doc["policies"]
    rr = float(pols["round_robin"]["hit_rate"]) if "round_robin" in pols else 0.0
    oracle = float(pols["oracle"]["hit_rate"]) if "oracle" in pols else 0.0
    t = Table(title=title)
    t.add_column("policy", style="bold")
    t.add_column("hit rate", justify="right")
    t.add_column("vs round_robin", justify="right")
    t.add_column("vs oracle", justify="right")
    t.add_column("TTFT p50 ms", justify="right")
    t.add_column("TTFT p90 ms", justify="right")
    t.add_column("hint overhead p50 ms", justify="right")
    t.add_column("requests", justify="right")
    for name, s in pols.items():
        hit = float(s["hit_rate"])
        t.add_row(
            name,
            f"{hit:.1%}",
            _ratio(hit, rr),
            f"{hit / oracle:.1%}" if oracle > 0 else "-",
            f"{float(s['ttft_p50_ms']):.1f}",
            f"{float(s['ttft_p90_ms']):.1f}",
            f"{float(s['hint_overhead_p50_ms']):.3f}",
            str(int(s["requests"])),
        )
    return t


def targets(doc: Mapping[str, Any]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets for one document: (target, met or None when not measurable, detail)."""
    pols: Mapping[str, Summary] = doc["policies"]
    out: list[tuple[str, bool | None, str]] = []
    ca = pols.get("cache_aware")

    def hit(name: str) -> float | None:
        s = pols.get(name)
        return float(s["hit_rate"]) if s is not None else None

    ca_hit, or_hit, rr_hit = hit("cache_aware"), hit("oracle"), hit("round_robin")
    if ca_hit is not None and or_hit is not None and or_hit > 0:
        out.append(("cache_aware hit rate >= 95% of oracle's", ca_hit >= 0.95 * or_hit,
                    f"{ca_hit:.3f} vs {or_hit:.3f} ({ca_hit / or_hit:.1%})"))
    else:
        out.append(("cache_aware hit rate >= 95% of oracle's", None, "not measured"))
    if ca_hit is not None and rr_hit is not None:
        ok = ca_hit >= 3 * rr_hit
        ratio = f"{ca_hit / rr_hit:.2f}x" if rr_hit > 0 else "inf"
        out.append(("cache_aware hit rate >= 3x round_robin's", ok,
                    f"{ca_hit:.3f} vs {rr_hit:.3f} ({ratio})"))
    else:
        out.append(("cache_aware hit rate >= 3x round_robin's", None, "not measured"))
    ap = pols.get("approximate")
    if ca is not None and ap is not None:
        a, b = float(ca["ttft_p90_ms"]), float(ap["ttft_p90_ms"])
        out.append(("cache_aware TTFT p90 < approximate's", a < b, f"{a:.1f} ms vs {b:.1f} ms"))
    else:
        out.append(("cache_aware TTFT p90 < approximate's", None, "not measured"))
    if ca is not None:
        h = float(ca["hint_overhead_p50_ms"])
        out.append(("hint overhead p50 < 1 ms", h < 1.0, f"{h:.3f} ms"))
    else:
        out.append(("hint overhead p50 < 1 ms", None, "not measured"))
    return out


def targets_table(docs: Sequence[Mapping[str, Any]]) -> Table:
    t = Table(title="targets")
    t.add_column("workload")
    t.add_column("target")
    t.add_column("met", justify="center")
    t.add_column("measured")
    for doc in docs:
        for name, ok, detail in targets(doc):
            mark = "-" if ok is None else ("[green]yes[/green]" if ok else "[red]no[/red]")
            t.add_row(str(doc["workload"]), name, mark, detail)
    return t


def plot(docs: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], title: str) -> Path:
    """A PNG: hit rate and TTFT p50/p90 per policy, one column of panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(docs))
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n + 1, 7), squeeze=False)
    colors = {"round_robin": "#9e9e9e", "random": "#bdbdbd", "approximate": "#f0a030",
              "cache_aware": "#2e7d32", "oracle": "#1565c0"}
    for col, doc in enumerate(docs):
        pols: Mapping[str, Summary] = doc["policies"]
        names = list(pols)
        x = list(range(len(names)))
        c = [colors.get(p, "#7e57c2") for p in names]
        ax = axes[0][col]
        hits = [float(pols[p]["hit_rate"]) * 100 for p in names]
        ax.bar(x, hits, color=c)
        ax.set_title(f"{doc['workload']}: prefix-cache hit rate")
        ax.set_ylabel("% of prompt tokens")
        ax.set_ylim(0, 100)
        ax.set_xticks(x, names, rotation=30, ha="right")
        for xi, h in zip(x, hits, strict=True):
            ax.text(xi, h + 1, f"{h:.0f}", ha="center", fontsize=8)
        ax = axes[1][col]
        p50 = [float(pols[p]["ttft_p50_ms"]) for p in names]
        p90 = [float(pols[p]["ttft_p90_ms"]) for p in names]
        w = 0.38
        ax.bar([xi - w / 2 for xi in x], p50, w, color=c, alpha=0.55, label="p50")
        ax.bar([xi + w / 2 for xi in x], p90, w, color=c, label="p90")
        ax.set_title(f"{doc['workload']}: time to first token")
        ax.set_ylabel("ms")
        top = max([*p90, 1.0])
        if top > 20 * max(1.0, min(v for v in p90 if v > 0) if any(p90) else 1.0):
            ax.set_yscale("log")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def is_document(doc: Any) -> bool:
    """Whether ``doc`` has exactly the JSON shape above (tests)."""
    if not isinstance(doc, dict) or set(doc) != {"workload", "policies"}:
        return False
    if not isinstance(doc["workload"], str) or not isinstance(doc["policies"], dict):
        return False
    for s in doc["policies"].values():
        if not isinstance(s, dict) or set(s) != set(FIELDS):
            return False
        if type(s["requests"]) is not int:
            return False
        for k in FIELDS:
            if k != "requests" and (type(s[k]) is not float or not math.isfinite(s[k])):
                return False
    return True
