"""The soak test's report (soak.py): its checks from what the clients saw and the server's counters, as JSON and
markdown."""

from __future__ import annotations

import dataclasses
import signal
import statistics
from collections import Counter


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def config_of(cfg) -> dict:
    """The report's record of a run's options (`soak.SoakConfig`), under the names of `blockdraft soak`'s flags."""
    server = cfg.server
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("server", "out")}
    out.update(target=server.target, draft=server.draft, dtype=server.dtype, max_batch=server.max_batch,
               max_queue=server.max_queue, max_tokens=server.max_tokens_cap, threads=server.threads)
    return out


def summarize(cfg, tally, rss: list[tuple[float, int]], warmup_end: float, end: float, probes: tuple,
              metrics_before: dict, metrics_after: dict, health: dict, exit_code: int | None, wall: float) -> dict:
    """The report of a soak run of cfg (`soak.SoakConfig`): tally is what the clients saw (`soak.Tally`), rss the
    server's (time, bytes)."""
    recs = tally.records
    statuses = Counter(r["status"] for r in recs)
    four = Counter(f'{r["status"]} {r.get("code")}' for r in recs if r["status"] and 400 <= r["status"] < 500)
    five = sum(n for s, n in statuses.items() if s and s >= 500)
    lost = [r for r in recs if r.get("lost")]
    dup_ids = sum(n - 1 for n in tally.ids.values() if n > 1) + sum(1 for r in recs if r.get("duplicated"))
    ok = [r for r in recs if r["status"] == 200 and not r.get("abandon") and not r.get("lost")]
    over_cap = [r for r in ok if r.get("usage") and r.get("max_tokens")
                and r["usage"]["completion_tokens"] > r["max_tokens"]]
    invalid_not_4xx = [r for r in recs if r["kind"] == "invalid" and not (r["status"] and 400 <= r["status"] < 500)]
    lat = {k: [r["latency"] for r in ok if (r["stream"] if k == "stream" else not r["stream"])]
           for k in ("stream", "non-stream")}

    def med(lo: float, hi: float) -> float | None:
        xs = [b for t, b in rss if lo <= t <= hi]
        return statistics.median(xs) if xs else None

    rss_start, rss_end = med(warmup_end, warmup_end + 60), med(end - 60, end)
    growth = (rss_end - rss_start) / rss_start if rss_start and rss_end else None

    def d(name: str, **labels) -> float:
        key = (f"blockdraft:{name}", tuple(sorted(labels.items())))
        return metrics_after.get(key, 0.0) - metrics_before.get(key, 0.0)

    server_by_status = Counter()
    for (name, labels), v in metrics_after.items():
        lab = dict(labels)
        if name == "blockdraft:http_requests_total" and lab["endpoint"].startswith("/v1/c"):
            server_by_status[lab["status"]] += v - metrics_before.get((name, labels), 0.0)
    client_by_status = Counter(str(r["status"]) for r in recs if r["status"])
    drafts, accepted = d("spec_decode_num_drafts_total"), d("spec_decode_num_accepted_tokens_total")
    checks = {
        "no_5xx": five == 0,
        "none_lost": not lost,
        "none_duplicated": dup_ids == 0,
        "invalid_got_4xx": not invalid_not_4xx,
        "max_tokens_respected": not over_cap,
        "rss_flat": growth is not None and growth <= cfg.rss_tolerance,
        "probe_identical": probes[0] == probes[1],
        "server_counts_match_clients": {k: v for k, v in server_by_status.items() if v} == dict(client_by_status),
        "server_no_engine_errors": health.get("errors") == 0 and health.get("worker_alive") is True,
        "clean_exit": exit_code in (0, -signal.SIGTERM),
    }
    return {
        "config": config_of(cfg),
        "wall_seconds": round(wall, 1),
        "requests_sent": len(recs),
        "completed_200": len(ok),
        "by_kind": dict(Counter(r["kind"] for r in recs)),
        "status_counts": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "4xx_by_reason": dict(sorted(four.items())),
        "429": statuses.get(429, 0),
        "5xx": five,
        "lost": len(lost),
        "lost_examples": [{k: r.get(k) for k in ("kind", "path", "stream", "status", "exception")} for r in lost[:5]],
        "duplicated": dup_ids,
        "abandoned_streams": sum(1 for r in recs if r["kind"] == "abandon" and r["status"] == 200),
        "server_cancelled": health.get("cancelled"),
        "latency_seconds": {k: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in lat.items()},
        "generated_tokens": sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage")),
        "rss_mb": {"start": rss_start and round(rss_start / 2**20, 1), "end": rss_end and round(rss_end / 2**20, 1),
                   "max": round(max(b for _, b in rss) / 2**20, 1) if rss else None,
                   "growth_fraction": growth and round(growth, 4),
                   "series": [(round(t - rss[0][0]), round(b / 2**20, 1)) for t, b in rss[::6]]},
        "probe": {"identical": probes[0] == probes[1], "start": probes[0], "end": probes[1]},
        "server_metrics": {"http_by_status": dict(server_by_status), "tau": 1 + accepted / drafts if drafts else None,
                           "acceptance_rate": accepted / d("spec_decode_num_draft_tokens_total")
                           if d("spec_decode_num_draft_tokens_total") else None},
        "server_exit_code": exit_code,
        "checks": checks,
        "passed": all(checks.values()),
    }


def markdown(rep: dict) -> str:
    c = rep["config"]
    lat = rep["latency_seconds"]
    rows = [
        f"# Soak: {c['minutes']} min, {c['concurrency']} clients, max-batch {c['max_batch']}, max-queue "
        f"{c['max_queue']}, target {c['target'] or 'default'}, draft {c['draft'] or 'default'}",
        "", f"Command: `{c['command']}`", "",
        "| figure | value |", "| --- | --- |",
        f"| requests sent | {rep['requests_sent']} ({', '.join(f'{k} {v}' for k, v in rep['by_kind'].items())}) |",
        f"| completed (200, not abandoned) | {rep['completed_200']} |",
        f"| 4xx by reason | {', '.join(f'{k}: {v}' for k, v in rep['4xx_by_reason'].items()) or 'none'} |",
        f"| 429 (bursts above the queue) | {rep['429']} |",
        f"| 5xx | {rep['5xx']} |",
        f"| lost / duplicated | {rep['lost']} / {rep['duplicated']} |",
        f"| streams abandoned by the client / cancelled by the server | {rep['abandoned_streams']} / "
        f"{rep['server_cancelled']} |",
    ]
    for k, v in lat.items():
        if v["n"]:
            rows.append(f"| latency {k} p50 / p99 (s) | {v['p50']:.2f} / {v['p99']:.2f} (n={v['n']}) |")
    r, sm = rep["rss_mb"], rep["server_metrics"]
    rows += [
        f"| server RSS first minute / last minute / max (MB) | {r['start']} / {r['end']} / {r['max']} "
        f"(growth {r['growth_fraction']}) |",
        f"| greedy probe identical at start and end | {rep['probe']['identical']} |",
        f"| tau / acceptance rate (from /metrics) | {sm['tau'] and round(sm['tau'], 3)} / "
        f"{sm['acceptance_rate'] and round(sm['acceptance_rate'], 3)} |",
        "", "Checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in rep["checks"].items()),
        "", f"RSS series (s, MB): {r['series']}", "",
        "Latencies were measured on a shared 2-core machine under `nice -n 19`: they describe this run, not the "
        "server's speed.",
    ]
    return "\n".join(rows) + "\n"
