"""The tables ``bench.graph.exact_table`` prints last, and the targets it checks: exact requests
from the table at least as fast as sampled ones at p99 <= the bound, and the table vs computing
exact embeddings on the fly."""

from __future__ import annotations

from typing import Any

from bench.graph.table_watch import fivexx, ratio
from loadtest.stats import fmt

SERVING_HEADER = ("| daemon | protocol | request | callers | p50 ms | p99 ms | p99.9 ms | req/s "
                  "| ids/s | errors |\n|---|---|---|---|---|---|---|---|---|---|")
BOUND_HEADER = ("| daemon | protocol | request | req/s | ids/s | callers | p99 ms "
                "| exact from table / on the fly |\n|---|---|---|---|---|---|---|---|")
BUILD_HEADER = ("| config | nodes | layer widths | where | MiB | build s | daemon ready s | source "
                "|\n|---|---|---|---|---|---|---|---|")
REFRESH_HEADER = (
    "| exact req/s offered | edge updates/s target / acked | update p50 / p99 ms "
    "| rows refreshed/s | table staleness p50 / p99 ms (histogram) | table behind p99 / max ms "
    "(polled) | version lag p99 / max | stale rows p50 / max (polled) | exact from table / on "
    "the fly | sampled req/s | sampled p50 / p99 / p99.9 ms | exact p50 / p99 ms "
    "| 5xx sampled / exact / updates |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def serving_line(s: dict, p: dict) -> str:
    errs = ", ".join(f"{k}:{v}" for k, v in sorted(p["errors"].items())) or "0"
    return (f"| {s['mode']} | {s['protocol']} | {s['request']} | {p['level']:g} | "
            f"{fmt(p['p50_ms'])} | {fmt(p['p99_ms'])} | {fmt(p['p999_ms'])} | "
            f"{p['req_per_s']:,.1f} | {p['seed_nodes_per_s']:,.0f} | {errs} |")


def bound_line(s: dict) -> str:
    best = s["under_bound"]
    c = s.get("counters") or {}
    src = f"{fmt(c.get('from_table'), '.0f')} / {fmt(c.get('on_the_fly'), '.0f')}"
    if best is None:
        most = s["most"] or {}
        return (f"| {s['mode']} | {s['protocol']} | {s['request']} | none under the bound "
                f"(most: {most.get('req_per_s', 0):,.1f} req/s at p99 "
                f"{fmt(most.get('p99_ms'))} ms) | - | - | - | {src} |")
    return (f"| {s['mode']} | {s['protocol']} | {s['request']} | {best['req_per_s']:,.1f} | "
            f"{best['seed_nodes_per_s']:,.0f} | {best['level']:g} | {fmt(best['p99_ms'])} | "
            f"{src} |")


def find(series: list[dict], mode: str, protocol: str, request: str) -> dict | None:
    return next((s for s in series if (s["mode"], s["protocol"], s["request"])
                 == (mode, protocol, request)), None)


def targets(series: list[dict], bound_ms: float) -> dict[str, Any]:
    """Per protocol: exact from the table vs sampled at p99 <= the bound (target: >= 1), and the
    table vs on the fly (most req/s of any point, and at the bound)."""
    out: dict[str, Any] = {}
    for protocol in dict.fromkeys(s["protocol"] for s in series):
        table = find(series, "table", protocol, "exact")
        sampled = find(series, "table", protocol, "sampled")
        fly = find(series, "on_the_fly", protocol, "exact")

        def req_s(s: dict | None, key: str) -> float | None:
            """None: not measured; 0: measured, no point under the bound."""
            if not s or not s["points"]:
                return None
            return (s[key] or {}).get("req_per_s", 0.0)

        t_b, s_b = req_s(table, "under_bound"), req_s(sampled, "under_bound")
        out[protocol] = {
            "bound_ms": bound_ms, "exact_table_req_per_s": t_b, "sampled_req_per_s": s_b,
            "exact_over_sampled": ratio(t_b, s_b),
            "meets_target": None if t_b is None or s_b is None else t_b >= s_b and t_b > 0,
            "on_the_fly_req_per_s_at_bound": req_s(fly, "under_bound"),
            "sampled_without_table_req_per_s": req_s(
                find(series, "on_the_fly", protocol, "sampled"), "under_bound"),
            "table_over_on_the_fly_most": ratio(req_s(table, "most"), req_s(fly, "most")),
            "p50_on_the_fly_over_table_1_caller": ratio(p50_at_one(fly), p50_at_one(table)),
        }
    return out


def p50_at_one(s: dict | None) -> float | None:
    if not s:
        return None
    return next((p["p50_ms"] for p in s["points"] if p["level"] == 1), None)


def target_lines(t: dict[str, Any]) -> list[str]:
    lines = []
    for protocol, v in t.items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[v["meets_target"]]
        lines.append(
            f"{protocol}: exact (table) {fmt(v['exact_table_req_per_s'], ',.1f')} vs sampled "
            f"{fmt(v['sampled_req_per_s'], ',.1f')} req/s at p99 <= {v['bound_ms']:g} ms: "
            f"{fmt(v['exact_over_sampled'])}x ({verdict}); table / on the fly, most req/s: "
            f"{fmt(v['table_over_on_the_fly_most'], ',.1f')}x; p50 at 1 caller, on the fly / "
            f"table: {fmt(v['p50_on_the_fly_over_table_1_caller'], ',.1f')}x"
            + ("" if v["sampled_without_table_req_per_s"] is None else
               f"; sampled without the table {v['sampled_without_table_req_per_s']:,.1f} req/s"))
    return lines


def build_line(r: dict) -> str:
    mib = None if r.get("bytes") is None else r["bytes"] / 2**20
    dims = "-" if not r.get("dims") else str(r["dims"])
    nodes = "-" if r.get("nodes") is None else f"{r['nodes']:,}"
    return (f"| {r['config']} | {nodes} | {dims} | {r.get('where') or '-'} | {fmt(mib, ',.1f')} "
            f"| {fmt(r.get('build_s'))} | {fmt(r.get('ready_s'), '.1f')} | "
            f"{r.get('source') or 'not reported'} |")


def refresh_line(r: dict) -> str:
    polled = r["table_polled"]
    return (f"| {r['exact_offered_req_per_s']:g} | "
            f"{r['target_edges_per_s']:,.0f} / {r['acked_edges_per_s']:,.0f} | "
            f"{fmt(r['update_p50_ms'])} / {fmt(r['update_p99_ms'])} | "
            f"{fmt(r['rows_refreshed_per_s'], ',.0f')} | "
            f"{fmt(r['table_staleness_p50_ms'])} / {fmt(r['table_staleness_p99_ms'])} | "
            f"{fmt(polled['behind_ms']['p99'])} / {fmt(polled['behind_ms']['max'])} | "
            f"{fmt(polled['version_lag']['p99'], '.0f')} / "
            f"{fmt(polled['version_lag']['max'], '.0f')} | "
            f"{fmt(polled['stale_rows']['p50'], ',.0f')} / "
            f"{fmt(polled['stale_rows']['max'], ',.0f')} | "
            f"{fmt(r['exact_from_table'], '.0f')} / {fmt(r['exact_on_the_fly'], '.0f')} | "
            f"{r['sampled_req_per_s']:,.1f} | {fmt(r['sampled_p50_ms'])} / "
            f"{fmt(r['sampled_p99_ms'])} / {fmt(r['sampled_p999_ms'])} | "
            f"{fmt(r['exact_p50_ms'])} / {fmt(r['exact_p99_ms'])} | "
            f"{r['sampled_5xx']} / {r['exact_5xx']} / {r['update_5xx']} |")


def exact_5xx(series: list[dict], mode: str) -> int:
    return sum(fivexx(p["errors"]) for s in series if s["mode"] == mode
               and s["request"] == "exact" for p in s["points"])


def print_report(result: dict[str, Any]) -> None:
    """Serving points, throughput at the bound, targets; builds; the refresh step."""
    info, series = result["meta"], result["series"]
    print(f"\n{info.get('graph')}, {info.get('device')}, {info.get('workload')}")
    print(SERVING_HEADER)
    for s in series:
        for p in s["points"]:
            print(serving_line(s, p))
    print(f"\nthroughput at p99 <= {info.get('bound_ms', 10.0):g} ms (the best point under it):")
    print(BOUND_HEADER)
    for s in series:
        print(bound_line(s))
    for line in target_lines(result["targets"]):
        print(line)
    print("\ntable build:")
    print(BUILD_HEADER)
    for r in result["builds"]:
        print(build_line(r))
    rows = result["refresh"]
    if not rows:
        print("\nrefresh under updates: not run")
        return
    share = "a fixed rate" if info.get("sampled_rate") else \
        f"{info.get('load_fraction')} of capacity"
    print(f"\nrefresh under updates (sampled at {share}, "
          f"{fmt(rows[0]['sampled_offered_req_per_s'], ',.0f')} req/s offered, HTTP npy):")
    print(REFRESH_HEADER)
    for r in rows:
        print(refresh_line(r))
