"""The reports of ``agentkv bench serve``: markdown tables, the paired comparisons, serve.json/.md/.png."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentkv.bench.serve_paired import comparison_lines

from .plots import plot, plot_setups
from .targets import SERVERS

__all__ = ["JSON_NAME", "comparison_report", "confusion_markdown", "markdown_table", "warmup_lines", "write_json",
           "write_reports"]

JSON_NAME = "serve.json"  # in the output folder: the result, rewritten after every block of a run

_log = logging.getLogger(__name__)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (rate, setup, server), plus agentkv's TTFT as a fraction of vanilla's in the
    same rate and setup. The setup column (and the replicas' share of the prompt tokens) appears
    when some row ran behind a router."""
    by_key = {(r["rate"], r.get("setup", "single"), r["server"]): r for r in rows}
    setups = list(dict.fromkeys(r.get("setup", "single") for r in rows))
    routed = setups != ["single"]
    head = "| sessions/s | " + ("setup | " if routed else "") + "server | hit rate | anchor kept | TTFT mean " \
        "| TTFT p50 | TTFT p99 | turn mean | turn p99 | turns/s | TTFT vs vanilla | " \
        + ("replica share | " if routed else "") + "load avg |"
    lines = [head, "|---:|" + ("---|" if routed else "") + "---|" + "---:|" * (9 + routed) + "---:|"]

    def order(r: dict[str, Any]) -> tuple[Any, ...]:
        server = SERVERS.index(r["server"]) if r["server"] in SERVERS else 9
        return r["rate"], setups.index(r.get("setup", "single")), server

    for r in sorted(rows, key=order):
        setup = r.get("setup", "single")
        base = by_key.get((r["rate"], setup, "vanilla"))
        ratio = f"{r['ttft_mean_ms'] / base['ttft_mean_ms']:.2f}x" if base and r is not base else ""
        errors = f" ({r['errors']} errors)" if r.get("errors") else ""
        share = "/".join(f"{x:.0%}" for x in r.get("engine_share", []))
        lines.append(
            f"| {r['rate']:g} | " + (f"{setup} | " if routed else "")
            + f"{r['server']}{errors} | {r['hit_rate']:.1%} | {_pct(r.get('anchor_hit_rate'))} "
            f"| {r['ttft_mean_ms']:.0f} ms "
            f"| {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {r['turn_mean_ms']:.0f} ms "
            f"| {r['turn_p99_ms']:.0f} ms | {r['throughput']:.2f} | {ratio} | "
            + (f"{share} | " if routed else "") + f"{_load_range(r.get('load'))} |"
        )
    return "\n".join(lines)


def confusion_markdown(row: dict[str, Any]) -> str:
    """A row's confusion table: one line per true agent, one column per recognized agent."""
    table: dict[str, dict[str, int]] = row["confusion"]
    found = sorted({f for counts in table.values() for f in counts}, key=lambda f: (f in "-?", f))
    lines = [f"{row['server']} at {row['rate']:g} sessions/s: true agent (rows) vs recognized agent (columns)", "",
             "| agent | " + " | ".join(found) + " |", "|---|" + "---:|" * len(found)]
    lines += [f"| {agent} | " + " | ".join(str(counts.get(f, "")) for f in found) + " |"
              for agent, counts in table.items()]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.0%}"


def _load_range(load: Sequence[float] | None) -> str:
    return "" if not load else f"{load[0]:.1f}-{load[-1]:.1f}"


def comparison_report(result: dict[str, Any]) -> list[str]:
    """The paired ratios with their intervals, one paragraph per (rate, setup, server, baseline)."""
    lines = []
    for c in result.get("comparisons", []):
        name = c["server"] if c["setup"] == "single" else f"{c['server']} {c['setup']}"
        lines += [*comparison_lines(c["rate"], c, name, c.get("baseline", "vanilla")), ""]
    return lines


def bound_lines(result: dict[str, Any]) -> list[str]:
    """How close agentkv's eviction came to Belady's on its own traffic (when the run traced it)."""
    figures = result.get("bound")
    if not figures:
        return []
    closed = figures["closed"]
    gap = "" if closed is None else f": {closed:.0%} of the LRU -> Belady gap"
    return [f"agentkv's traffic replayed offline (agentkv bench bound {figures['trace']} --skip-sessions warmup-): "
            "prompt tokens found "
            f"cached {figures['measured']:.1%} on the server, {figures['lru']:.1%} under LRU, "
            f"{figures['belady']:.1%} under Belady (evicting by the future){gap}"]


def warmup_lines(result: dict[str, Any]) -> list[str]:
    """What each warm-up arm's coordinator decided and what the server saw become of its warm-ups."""
    lines = []
    for r in result["rows"]:
        counts = r.get("warmups")
        if not counts:
            continue
        where = "" if r.get("setup", "single") == "single" else f" {r['setup']}"
        skipped = ", ".join(f"{k.removeprefix('skipped_')} {n}" for k, n in counts.items() if k.startswith("skipped_"))
        outcomes = ", ".join(f"{k} {counts[f'server_{k}']}" for k in ("useful", "wasted", "redundant")
                             if f"server_{k}" in counts)
        unread = counts.get("server_unread", 0)
        lines.append(f"{r['server']}{where} at {r['rate']:g} sessions/s: warm-ups sent {counts.get('sent', 0)}"
                     + (f" ({outcomes}, as the server saw them)" if outcomes else "")
                     + (f" ({unread} reads of the server's outcomes failed: they are short)" if unread else "")
                     + (f"; decisions skipped: {skipped}" if skipped else ""))
    return lines


def write_json(result: dict[str, Any], path: Path) -> None:
    """``result`` as strict JSON: a figure with no data (NaN) or an infinity is null (bare NaN is
    no JSON: jq and JavaScript refuse the file). Written to a temporary file that then replaces
    ``path``: a run killed while writing leaves the previous version whole, and no temporary file
    (a SIGKILLed one leaves its file, which the next write to ``path`` removes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(path)
    text = json.dumps(_finite(result), indent=2, default=str, allow_nan=False) + "\n"
    # one per process: two runs writing to the same folder never replace with each other's half-written file
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except BaseException:  # Ctrl-C or SIGTERM (a KeyboardInterrupt here: see servers.running), a full disk
        temporary.unlink(missing_ok=True)
        raise


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporary files of ``path`` whose writer is gone (SIGKILLed, or the machine
    crashed): they would pile up in the output folder. A live run's file stays, and so does a name
    that holds no pid."""
    if os.name != "posix":  # on Windows os.kill(pid, 0) does not ask: it terminates the process
        return
    prefix, suffix = f".{path.name}.", ".partial"
    removed = []
    for candidate in path.parent.iterdir():
        pid = candidate.name.removeprefix(prefix).removesuffix(suffix)
        if candidate.name != f"{prefix}{pid}{suffix}" or not (pid.isascii() and pid.isdigit()) or not _gone(int(pid)):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate.name)
    if removed:
        _log.warning("%s: removed %d temporary files left by runs killed while writing it: %s",
                     path, len(removed), ", ".join(sorted(removed)))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's live process; a number no pid can be: left alone
        pass
    return False


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_reports(result: dict[str, Any], out: Path, plot_path: Path | None = None) -> dict[str, Path]:
    """Write serve.md and serve.png (or ``plot_path``) of a run's ``result``; the paths of all three.
    serve.json is the run's own (see :func:`agentkv.bench.serve.run_benchmark`): written once at its
    end, not again here."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "md": out / "serve.md"}
    tables = [markdown_table(result["rows"]),
              "\n".join([*comparison_report(result), *warmup_lines(result), *bound_lines(result)])]
    tables += [confusion_markdown(r) for r in result["rows"] if r.get("confusion")]
    paths["md"].write_text("\n\n".join(tables) + "\n")
    c = result["config"]
    title = (f"{c['sessions']} sessions/rate x {c.get('repeats', 1)} repeats, {c['turns']} turns, "
             f"{int(c['blocks']) - 1} blocks x {c['block_size']} tokens, tool gap {c['tool_gap']} s, seed {c['seed']}")
    if any(r.get("setup", "single") != "single" for r in result["rows"]):
        title += f"; {c['replicas']} replicas share the blocks"
        png = plot_setups(result["rows"], plot_path or out / "serve.png", title)
    else:
        png = plot(result["rows"], plot_path or out / "serve.png", title)
    if png is not None:
        paths["png"] = png
    return paths
