"""The figures of ``bench.models.reload`` from what it recorded, the issue's targets, and the
printed table.

The swap window runs from the load call until ``swap_s`` after both the first answer naming the
new version and the call's answer (so the old version's drain and unload fall inside it); the
window before it starts at the measured window's start, the one after ends at its end. Requests
belong to the window they were scheduled in (open loop: latency from the scheduled send).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from loadtest.recorder import Records
from loadtest.stats import fmt

OLD, NEW = 1, 2  # the version served at start, the one loaded under load
#: an engine core's log line when a loaded version starts serving (engine/core/model_load.py)
SERVING_LINE = re.compile(r"engine (\d+): (\S+) version (\d+) serving \(load (\{[^}]*\})\)")
TABLE_HEADER = ("| window | from (s into the window) + length | served req/s "
                "| p50 / p99 / p99.9 ms | failed | answers by version |\n|---|---|---|---|---|---|")


def reload_figures(recs: Records, call: dict[str, Any], swap_s: float,
                   steady: dict[str, Any] | None) -> dict[str, Any]:
    """The load call (``t_call``, ``t_answer``: wall clock; ``status``, ``answer``, ``error``,
    ``write_s``), the first new-version answer, the windows around the swap, failures."""
    t_call = call.get("t_call")
    out: dict[str, Any] = {
        "failed_run": recs.failed(), "statuses_run": recs.statuses(),
        "load_cpu_cores": recs.cpu_cores, "conn_errors": recs.conn_errors,
        "load_call": {"status": call.get("status"), "answer": call.get("answer"),
                      "error": call.get("error"), "write_s": call.get("write_s"),
                      "at_s": None if t_call is None else t_call - recs.win0,
                      "wall_s": None if t_call is None else call["t_answer"] - t_call},
        "first_new_answer_s": None, "last_old_answer_s": None, "old_answers_after_first_new": 0,
        "windows": {}, "swap_window_closed": False, "p99_swap_over_steady": None,
        "p99_swap_over_before": None}
    if t_call is None:
        return out
    new, old = recs.answers(NEW), recs.answers(OLD)
    first_new = float(new[0]) if new.size else None
    if first_new is not None:
        out["first_new_answer_s"] = first_new - t_call
        out["old_answers_after_first_new"] = int((old > first_new).sum())
    if old.size:
        out["last_old_answer_s"] = float(old[-1]) - t_call
    swap_end = min(max(first_new or recs.win1, call["t_answer"]) + swap_s, recs.win1)
    windows = {"before": recs.window(recs.win0, t_call), "swap": recs.window(t_call, swap_end),
               "after": recs.window(swap_end, recs.win1) if swap_end < recs.win1 else None}
    out["windows"] = windows
    out["swap_window_closed"] = first_new is not None and swap_end < recs.win1
    swap_p99 = windows["swap"]["p99_ms"]
    for key, base in (("p99_swap_over_steady", (steady or {}).get("p99_ms")),
                      ("p99_swap_over_before", windows["before"]["p99_ms"])):
        if base and swap_p99 is not None:
            out[key] = swap_p99 / base
    return out


def serving_lines(log_path: Path) -> list[dict[str, Any]]:
    """Each engine core's 'version N serving (load {...})' line of the daemon's log: what its
    load took (build, CUDA graphs, warm-up, exact table)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    rows = []
    for m in SERVING_LINE.finditer(text):
        try:
            load_s = ast.literal_eval(m.group(4))
        except (ValueError, SyntaxError):
            load_s = m.group(4)
        rows.append({"engine": int(m.group(1)), "model": m.group(2),
                     "version": int(m.group(3)), "load_s": load_s})
    return rows


def targets(steady: dict[str, Any] | None, reload: dict[str, Any] | None,
            first_max_s: float, ratio_max: float) -> dict[str, Any]:
    """The issue's targets against what was measured (None: not measured): no failed request
    in either run, the first new-version answer within ``first_max_s`` of the call, p99 during
    the swap within ``ratio_max`` x steady."""
    failed = None if steady is None or reload is None else \
        steady["failed_run"] + reload["failed_run"]
    first = (reload or {}).get("first_new_answer_s")
    ratio = (reload or {}).get("p99_swap_over_steady")
    return {"failed": failed, "failed_max": 0,
            "no_failures": None if failed is None else failed == 0,
            "first_new_answer_s": first, "first_new_answer_max_s": first_max_s,
            "first_new_answer_met": None if first is None else first <= first_max_s,
            "p99_swap_over_steady": ratio, "p99_ratio_max": ratio_max,
            "p99_met": None if ratio is None else ratio <= ratio_max}


def row_line(name: str, w: dict[str, Any]) -> str:
    versions = ", ".join(f"v{k}: {n}" for k, n in w["versions"].items()) or "-"
    return (f"| {name} | {w['from_s']:.2f} + {w['seconds']:.2f} s | {w['req_per_s']:,.0f} | "
            f"{fmt(w['p50_ms'])} / {fmt(w['p99_ms'])} / {fmt(w['p999_ms'])} | {w['failed']} | "
            f"{versions} |")


def reload_line(r: dict[str, Any]) -> str:
    call = r["load_call"]
    return (f"load call: status {call['status']}{' ' + call['error'] if call['error'] else ''}, "
            f"{fmt(call['wall_s'], '.3f')} s (version {NEW} written in "
            f"{fmt(call['write_s'], '.3f')} s before it); first answer of version {NEW} "
            f"{fmt(r['first_new_answer_s'], '.3f')} s after the call; last of version {OLD} "
            f"{fmt(r['last_old_answer_s'], '.3f')} s; failed requests {r['failed_run']}")


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "MISSED"


def print_summary(result: dict[str, Any]) -> None:
    """The load call, the targets, then the table (last)."""
    if result.get("reload"):
        print(reload_line(result["reload"]))
    t = result["targets"]
    print(f"targets: failed {t['failed']} (0): {verdict(t['no_failures'])}; first answer of "
          f"version {NEW} {fmt(t['first_new_answer_s'], '.3f')} s (<= "
          f"{t['first_new_answer_max_s']:g} s): {verdict(t['first_new_answer_met'])}; "
          f"p99 swap / steady {fmt(t['p99_swap_over_steady'])}x (<= "
          f"{t['p99_ratio_max']:g}x): {verdict(t['p99_met'])}")
    print(TABLE_HEADER)
    if result.get("steady"):
        print(row_line("steady", result["steady"]))
    for name, w in ((result.get("reload") or {}).get("windows") or {}).items():
        if w:
            print(row_line(f"reload: {name}", w))
