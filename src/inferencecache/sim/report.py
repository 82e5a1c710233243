"""Results of ``demo`` and ``simulate``: one JSON shape, a rich table, a PNG and the targets.

The JSON document is exactly::

    {"workload": "<name>",
     "policies": {"<policy>": {"hit_rate": float, "ttft_p50_ms": float, "ttft_p90_ms": float,
                               "requests": int, "hint_overhead_p50_ms": float}}}

``hit_rate`` is prefix-cache hit tokens / queried tokens as the engines count them; the hint
overhead is the time spent obtaining the policy's signal per request (LookupRoute for
``cache_aware``, the engines' cache queries for ``oracle``, 0 for the others).

``simulate`` adds the time series (requests grouped by arrival time)::

     "series": {"window_s": float,
                "policies": {"<policy>": [{"start_s": float, "span_s": float,
                                           "hit_rate": float, "ttft_p90_ms": float,
                                           "requests": int, "stale_hints": int}, ...]}}

``span_s`` is the part of the window the run covered (the last one may be partial);
``stale_hints`` counts the window's requests routed on a ``PREFIX_MATCH`` whose first replica
held fewer of the prompt's blocks than the hint said (``cache_aware`` only).
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
SERIES_FIELDS: Final = ("start_s", "span_s", "hit_rate", "ttft_p90_ms", "requests", "stale_hints")
_SERIES_INTS: Final = ("requests", "stale_hints")
SERIES_MIN_SPAN: Final = 0.5
"""Windows covering less than this share of ``window_s`` are left out of the targets."""
SERIES_MIN_ORACLE: Final = 0.97
SERIES_MAX_TTFT_DRIFT: Final = 1.10

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


def series_row(
    start_s: float, span_s: float, hit_rate: float, ttft_s: Sequence[float], requests: int,
    stale_hints: int = 0,
) -> dict[str, float | int]:
    """One window of a policy's time series."""
    return {
        "start_s": round(float(start_s), 3),
        "span_s": round(float(span_s), 3),
        "hit_rate": round(hit_rate, 6),
        "ttft_p90_ms": round(percentile(ttft_s, 90) * 1000, 3),
        "requests": int(requests),
        "stale_hints": int(stale_hints),
    }


def document(
    workload: str,
    policies: Mapping[str, Summary],
    series: Mapping[str, Sequence[Mapping[str, float | int]]] | None = None,
    window_s: float = 0.0,
) -> dict[str, Any]:
    """The JSON document (policies in the order given); ``series`` per policy, if any."""
    out: dict[str, dict[str, float | int]] = {}
    for name, s in policies.items():
        out[name] = {
            "hit_rate": float(s["hit_rate"]),
            "ttft_p50_ms": float(s["ttft_p50_ms"]),
            "ttft_p90_ms": float(s["ttft_p90_ms"]),
            "requests": int(s["requests"]),
            "hint_overhead_p50_ms": float(s["hint_overhead_p50_ms"]),
        }
    doc: dict[str, Any] = {"workload": workload, "policies": out}
    if series is not None:
        doc["series"] = {
            "window_s": float(window_s),
            "policies": {
                name: [{k: (int(r[k]) if k in _SERIES_INTS else float(r[k]))
                        for k in SERIES_FIELDS}
                       for r in rows]
                for name, rows in series.items()
            },
        }
    return doc


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
    if "series" in doc:
        out += series_targets(doc)
    return out


def full_windows(rows: Sequence[Mapping[str, Any]], window_s: float) -> list[Mapping[str, Any]]:
    """The rows the targets judge: covering at least half a window, with requests."""
    return [r for r in rows
            if float(r["span_s"]) >= SERIES_MIN_SPAN * window_s and int(r["requests"]) > 0]


def series_targets(doc: Mapping[str, Any]) -> list[tuple[str, bool | None, str]]:
    """Issue 11's long-horizon targets: after the first (warm-up) window, ``cache_aware`` stays
    >= 97% of the oracle's hit rate in every window, and its TTFT p90 never exceeds its first
    window's by more than 10%. Windows covering less than half a window are left out."""
    series = doc["series"]
    window_s = float(series["window_s"])
    pols: Mapping[str, Sequence[Mapping[str, Any]]] = series["policies"]
    name_o = f"cache_aware >= {SERIES_MIN_ORACLE:.0%} of oracle's hit rate in every window"
    name_t = f"cache_aware TTFT p90 <= {SERIES_MAX_TTFT_DRIFT:.2f}x its first window"
    ca = full_windows(pols.get("cache_aware", ()), window_s)
    orc = {float(r["start_s"]): r for r in full_windows(pols.get("oracle", ()), window_s)}
    out: list[tuple[str, bool | None, str]] = []
    later = ca[1:]
    pairs = [(r, orc[float(r["start_s"])]) for r in later if float(r["start_s"]) in orc]
    pairs = [(a, b) for a, b in pairs if float(b["hit_rate"]) > 0]
    if pairs:
        ratios = [(float(a["hit_rate"]) / float(b["hit_rate"]), float(a["start_s"]))
                  for a, b in pairs]
        worst, at = min(ratios)
        out.append((name_o, worst >= SERIES_MIN_ORACLE,
                    f"worst {worst:.1%} at {at / 60:.0f} min ({len(pairs)} windows)"))
    else:
        out.append((name_o, None, "fewer than 2 full windows"))
    first = float(ca[0]["ttft_p90_ms"]) if ca else 0.0
    if later and first > 0:
        drifts = [(float(r["ttft_p90_ms"]) / first, float(r["start_s"])) for r in later]
        worst_d, at_d = max(drifts)
        best_d = min(d for d, _ in drifts)
        out.append((name_t, worst_d <= SERIES_MAX_TTFT_DRIFT,
                    f"{first:.1f} ms first; {best_d:.2f}x-{worst_d:.2f}x later "
                    f"(worst at {at_d / 60:.0f} min)"))
    else:
        out.append((name_t, None, "fewer than 2 full windows"))
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
    timed = any("series" in d for d in docs)
    rows = 4 if timed else 2
    fig, axes = plt.subplots(rows, n, figsize=(4.2 * n + 1, 3.5 * rows), squeeze=False)
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
        if timed:
            _plot_series(axes[2][col], axes[3][col], doc, colors)
    fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _plot_series(hit_ax: Any, ttft_ax: Any, doc: Mapping[str, Any],
                 colors: Mapping[str, str]) -> None:
    """Hit rate and TTFT p90 per window over simulated time, one line per policy."""
    series = doc.get("series")
    if series is None:
        hit_ax.set_visible(False)
        ttft_ax.set_visible(False)
        return
    window_min = float(series["window_s"]) / 60
    for name, rows in series["policies"].items():
        xs = [(float(r["start_s"]) + float(r["span_s"]) / 2) / 60 for r in rows]
        color = colors.get(name, "#7e57c2")
        hit_ax.plot(xs, [float(r["hit_rate"]) * 100 for r in rows], marker="o", ms=3,
                    color=color, label=name)
        ttft_ax.plot(xs, [float(r["ttft_p90_ms"]) for r in rows], marker="o", ms=3,
                     color=color, label=name)
    hit_ax.set_title(f"{doc['workload']}: hit rate per {window_min:g} min")
    hit_ax.set_ylabel("% of prompt tokens")
    hit_ax.set_ylim(0, 100)
    ttft_ax.set_title(f"{doc['workload']}: TTFT p90 per {window_min:g} min")
    ttft_ax.set_ylabel("ms")
    for ax in (hit_ax, ttft_ax):
        ax.set_xlabel("simulated minutes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def is_document(doc: Any) -> bool:
    """Whether ``doc`` has exactly the JSON shape above (tests)."""
    if not isinstance(doc, dict) or set(doc) - {"series"} != {"workload", "policies"}:
        return False
    if "series" in doc and not _is_series(doc["series"]):
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


def _is_series(series: Any) -> bool:
    if not isinstance(series, dict) or set(series) != {"window_s", "policies"}:
        return False
    if type(series["window_s"]) is not float or not isinstance(series["policies"], dict):
        return False
    for rows in series["policies"].values():
        if not isinstance(rows, list):
            return False
        for r in rows:
            if not isinstance(r, dict) or set(r) != set(SERIES_FIELDS):
                return False
            if any(type(r[k]) is not int for k in _SERIES_INTS):
                return False
            if any(type(r[k]) is not float or not math.isfinite(r[k])
                   for k in SERIES_FIELDS if k not in _SERIES_INTS):
                return False
    return True
