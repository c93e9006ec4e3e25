"""Tables, targets and the plot of ``agentkv bench replay`` (pure functions of the results)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "index_results", "markdown", "plot", "targets"]

# Issue "Benchmarks, examples and the one-command demo": agentkv's token hit rate against lru.
TARGETS: dict[str, dict[str, float]] = {
    "selector": {"min_gain": 12.0, "min_closed": 0.70},
    "pipeline": {"min_gain": 12.0},
    "debate": {"min_gain": 12.0},
    "random": {"min_gain": -1.0},
}
AGENTKV_VARIANTS = ("agentkv", "agentkv+facts", "agentkv+warmup")


MIN_HEADROOM = 1.0  # points of hit rate between lru and belady (mean) below which no gap share is given


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def index_results(results: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """A replay report's results by (tape, capacity, policy)."""
    return {(r["tape"], r["capacity"], r["policy"]): r for r in results}


def _stats(cells: dict, name: str, variant: str, capacities: Sequence[int]) -> dict[str, Any]:
    gains = [100 * (cells[name, c, variant]["hit_rate"] - cells[name, c, "lru"]["hit_rate"]) for c in capacities]
    heads = [100 * (cells[name, c, "belady"]["hit_rate"] - cells[name, c, "lru"]["hit_rate"]) for c in capacities]
    rates = [100 * cells[name, c, variant]["hit_rate"] for c in capacities]
    lru = [100 * cells[name, c, "lru"]["hit_rate"] for c in capacities]
    return {"gain": round(sum(gains) / len(gains), 2), "min_gain": round(min(gains), 2),
            "headroom": round(sum(heads) / len(heads), 2),
            # a share of almost no headroom is noise (-1300% of 0.1 points): not given
            "closed": round(sum(gains) / sum(heads), 3) if sum(heads) >= MIN_HEADROOM * len(heads) else None,
            "spread": round(max(rates) - min(rates), 2), "lru_spread": round(max(lru) - min(lru), 2)}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tape and agentkv variant: mean gain over lru and share of the lru->belady gap closed
    on the kept capacities (the targets), and the same over every candidate capacity."""
    cells = index_results(report["results"])
    out = []
    for tape in report["tapes"]:
        name, topology, kept, every = tape["name"], tape.get("topology"), tape["kept"], tape["candidates"]
        for variant in AGENTKV_VARIANTS:
            ran = [c for c in every if (name, c, variant) in cells and (name, c, "belady") in cells]
            if not ran:
                continue
            row: dict[str, Any] = {"tape": name, "topology": topology, "policy": variant, "capacities": kept,
                                   "all": _stats(cells, name, variant, ran)}
            if kept:
                row.update(_stats(cells, name, variant, kept))
                goal = TARGETS.get(topology or "")
                if goal is not None:
                    ok = row["gain"] >= goal["min_gain"]
                    if "min_closed" in goal:
                        ok = ok and row["closed"] is not None and row["closed"] >= goal["min_closed"]
                    row["target"] = goal
                    row["met"] = ok
            out.append(row)
    return out


def markdown(report: dict[str, Any]) -> str:
    cells = index_results(report["results"])
    policies = report["policies"]
    lines = ["### Tapes", "",
             "| tape | sessions | requests | anchor share | R (target) | largest request (blocks) "
             "| candidates (blocks) |",
             "|---|---:|---:|---:|---|---:|---|"]
    for tape in report["tapes"]:
        s = tape["summary"]
        target = tape.get("target_r")
        lines.append(f"| {tape['name']} | {s['sessions']} | {s['requests']} | {_pct(s['anchor_share'])}% | "
                     f"{s['predictability']:.2f} ({'-' if target is None else f'{target:.2f}'}) | "
                     f"{tape['max_request_blocks']} | {', '.join(map(str, tape['candidates']))} |")
    lines += ["", f"### Pressure preflight (keep a capacity when belady - lru >= {report['margin']:g} points)", "",
              "| tape | capacity | lru | belady | belady - lru | kept |", "|---|---:|---:|---:|---:|---|"]
    for tape in report["tapes"]:
        for c in tape["candidates"]:
            lru, bel = cells[tape["name"], c, "lru"]["hit_rate"], cells[tape["name"], c, "belady"]["hit_rate"]
            lines.append(f"| {tape['name']} | {c} | {_pct(lru)} | {_pct(bel)} | {100 * (bel - lru):+.1f} | "
                         f"{'yes' if c in tape['kept'] else '**dropped**'} |")
    lines += ["", "### Token hit rate (%) on the kept capacities", ""]
    for tape in report["tapes"]:
        kept = tape["kept"]
        lines.append(f"**{tape['name']}**" + ("" if kept else ": every capacity dropped by the preflight"))
        lines.append("")
        if not kept:
            continue
        lines.append("| policy | " + " | ".join(f"{c} blocks" for c in kept) + " | mean |")
        lines.append("|---|" + "---:|" * (len(kept) + 1))
        for policy in policies:
            rates = [cells[tape["name"], c, policy]["hit_rate"] for c in kept if (tape["name"], c, policy) in cells]
            if len(rates) == len(kept):
                mean = _pct(sum(rates) / len(rates))
                lines.append(f"| {policy} | " + " | ".join(_pct(r) for r in rates) + f" | {mean} |")
        lines.append("")
    lines += ["### Details (every capacity run; dropped ones marked)", "",
              "| tape | capacity | policy | hit % | anchor hit % | history hit % | prefill tokens computed "
              "(warm-up incl.) | warm-up tokens | evictions (anchor / history) | mean wait s |",
              "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for tape in report["tapes"]:
        for c in tape["candidates"]:
            for policy in policies:
                r = cells.get((tape["name"], c, policy))
                if r is None:
                    continue
                mark = "" if c in tape["kept"] else " (dropped)"
                ev = r["evictions_by_kind"]
                lines.append(f"| {tape['name']} | {c}{mark} | {policy} | {_pct(r['hit_rate'])} | "
                             f"{_pct(r['anchor_hit_rate'])} | {_pct(r['history_hit_rate'])} | "
                             f"{r['computed_tokens']:,} | "
                             f"{r['warmup_tokens']:,} | {r['evictions']:,} ({ev['anchor']:,} / {ev['history']:,}) | "
                             f"{r['mean_wait_s']:.2f} |")
    lines += _warmup_lines(report, cells)
    rows = report.get("targets") or []
    if rows:
        lines += ["",
                  "### Targets (points of token hit rate; means over the kept capacities, then over all candidates)",
                  "", "| tape | policy | gain over lru | worst kept capacity | lru->belady gap closed | spread across "
                  "kept capacities (lru's) | target | met | all candidates: gain / belady headroom / closed |",
                  "|---|---|---:|---:|---:|---:|---|---|---|"]
        for row in rows:
            every = row["all"]
            closed_all = "-" if every["closed"] is None else f"{100 * every['closed']:.0f}%"
            tail = f"{every['gain']:+.1f} / {every['headroom']:+.1f} / {closed_all}"
            if "gain" not in row:
                lines.append(f"| {row['tape']} | {row['policy']} | - | - | - | - | - | no capacity kept | {tail} |")
                continue
            goal = row.get("target")
            text = "-" if goal is None else f">= {goal['min_gain']:+g} pts" + (
                f", >= {100 * goal['min_closed']:.0f}% closed" if "min_closed" in goal else "")
            closed = "-" if row["closed"] is None else f"{100 * row['closed']:.0f}%"
            met = "-" if "met" not in row else ("yes" if row["met"] else "**no**")
            lines.append(f"| {row['tape']} | {row['policy']} | {row['gain']:+.1f} | {row['min_gain']:+.1f} | "
                         f"{closed} | "
                         f"{row['spread']:.1f} ({row['lru_spread']:.1f}) | {text} | {met} | {tail} |")
    return "\n".join(lines) + "\n"


def _warmup_lines(report: dict[str, Any], cells: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """Per tape and capacity: what the warm-up policy decided and what the server saw become of it."""
    rows = [(tape, c, cells[tape["name"], c, "agentkv+warmup"]["policy_stats"]) for tape in report["tapes"]
            for c in tape["candidates"] if (tape["name"], c, "agentkv+warmup") in cells]
    rows = [(tape, c, stats) for tape, c, stats in rows if "warmup_outcomes" in stats]
    if not rows:
        return []
    lines = ["", "### Warm-ups of agentkv+warmup (decisions; outcomes counted by the server runtime)", "",
             "| tape | capacity | sent | useful | wasted (evicted / expired / missed) | redundant | useful share "
             "| skipped by reason |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for tape, c, stats in rows:
        o, waste = stats["warmup_outcomes"], stats["warmup_outcomes"]["wasted_by"]
        settled = o["useful"] + o["wasted"] + o["redundant"]
        share = f"{100 * o['useful'] / settled:.0f}%" if settled else "-"
        skipped = ", ".join(f"{k} {n}" for k, n in stats["warmups"].items() if k != "issued") or "-"
        mark = "" if c in tape["kept"] else " (dropped)"
        wasted = f"{o['wasted']} ({waste['evicted']} / {waste['expired']} / {waste['missed']})"
        lines.append(f"| {tape['name']} | {c}{mark} | {o['sent']} | {o['useful']} | {wasted} | {o['redundant']} | "
                     f"{share} | {skipped} |")
    return lines


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Hit rate vs capacity, one line per policy, one panel per tape (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = index_results(report["results"])
    tapes = report["tapes"]
    columns = 2 if len(tapes) > 1 else 1
    rows = -(-len(tapes) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 4.2 * rows), squeeze=False)
    styles = {"belady": ("k", "--"), "lru": ("tab:gray", "-"), "ttl": ("tab:brown", ":"),
              "kvflow": ("tab:purple", "-."),
              "agentkv": ("tab:blue", "-"), "agentkv+facts": ("tab:green", "-"), "agentkv+warmup": ("tab:red", "-")}
    for axis, tape in zip(axes.flat, tapes, strict=False):
        xs = tape["candidates"]
        for policy in report["policies"]:
            points = [(c, 100 * cells[tape["name"], c, policy]["hit_rate"]) for c in xs
                      if (tape["name"], c, policy) in cells]
            if not points:
                continue
            color, dash = styles.get(policy, (None, "-"))
            axis.plot([p[0] for p in points], [p[1] for p in points], linestyle=dash, marker="o", markersize=3,
                      color=color, label=policy)
        for c in xs:
            if c not in tape["kept"]:
                axis.axvspan(c - 0.02 * xs[-1], c + 0.02 * xs[-1], color="0.9", zorder=0)
        axis.set_title(f"{tape['name']} (R={tape['summary']['predictability']:.2f})")
        axis.set_xlabel("KV cache capacity (blocks of 16 tokens)")
        axis.set_ylabel("token hit rate (%)")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(tapes):]:
        axis.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    figure.suptitle("agentkv bench replay: real vLLM KVCacheManager, paired tapes (grey: dropped by the preflight)")
    figure.tight_layout(rect=(0, 0.05, 1, 0.96))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
