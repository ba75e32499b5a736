"""The benchmark's summary and report: per-task rows (tau, tok/s, paired speedups, step split, per-position
acceptance), the markdown report and the plots. Split from `bench.py`, which runs the methods."""

from __future__ import annotations

import math
from pathlib import Path

from ..decode.spec import REFERENCES, registry_entry
from . import metrics


def drafts(method: str) -> bool:
    """Whether a benchmark method drafts tokens through the engine (per-position acceptance, draft share): asked of
    the decode registry, for its methods, their `@MODE` weights variants and their Hugging Face variants."""
    entry = registry_entry(method)
    return entry is not None and entry.drafts


def _drafting(methods) -> list[str]:
    """The drafting methods among `methods`, in their order, once each."""
    return list(dict.fromkeys(m for m in methods if drafts(m)))


def fmt_temperature(t: float) -> str:
    return f"{t:g}"


def summarize_records(records: list[dict], methods: list[str], block_sizes: dict, temperatures) -> dict:
    """{temperature: {"tasks": [...], "rows": [one per (task or 'all', method)]}} from per-prompt records."""
    out = {}
    for temp in temperatures:
        recs = [r for r in records if r["temperature"] == temp]
        tasks = list(dict.fromkeys(r["task"] for r in recs))
        groups = [(t, [r for r in recs if r["task"] == t]) for t in tasks]
        if len(tasks) > 1:
            groups.append(("all", recs))
        rows = []
        for task, rs in groups:
            by_m = {m: {(r["task"], r["prompt_id"], r["turn"]): r for r in rs if r["method"] == m} for m in methods}
            ar = by_m["ar"]
            first = len(rows)
            for m in methods:
                mine = by_m[m]
                if not mine:
                    continue
                rows.append(_row(task, m, mine, ar, block_sizes.get(m)))
            _against_llamacpp(rows[first:], by_m, LLAMACPP_PLAIN, "vs_llamacpp")
            _against_llamacpp(rows[first:], by_m, LLAMACPP_SPEC, "vs_llamacpp_spec")
        out[fmt_temperature(temp)] = {"temperature": temp, "tasks": tasks, "rows": rows}
    return out


# llama.cpp decoding plainly on the target's own file: the reference a CPU user already has; and its speculative
# decoding with a smaller model of the family as the draft model, what that user can switch on
LLAMACPP_PLAIN = tuple(m for m, r in REFERENCES.items() if r.plain_llamacpp)
LLAMACPP_SPEC = tuple(m for m, r in REFERENCES.items() if r.draft == "family")


def _against_llamacpp(rows: list[dict], by_m: dict, refs: tuple[str, ...], key: str) -> None:
    """Give each of our methods' rows `key`: its per-prompt decode tokens/s over that of the faster (by median) of
    the llama.cpp methods `refs` in the run, paired by prompt; nothing when none ran."""
    plain = [m for m in refs if by_m.get(m)]
    if not plain:
        return
    tps = {m: {k: r["decode_tokens_per_s"] for k, r in by_m[m].items()} for m in plain}
    ref = max(plain, key=lambda m: metrics.summarize(v for v in tps[m].values() if v is not None)["median"] or 0.0)
    for row in rows:
        if row["method"].startswith("llamacpp"):
            continue
        mine = {k: r["decode_tokens_per_s"] for k, r in by_m[row["method"]].items()}
        if all(v is not None for v in mine.values()):
            row[key] = dict(metrics.throughput_speedup(mine, tps[ref]), against=ref)


def _row(task: str, method: str, mine: dict, ar: dict, block_size: int | None) -> dict:
    rs = list(mine.values())
    tps = {k: r["decode_tokens_per_s"] for k, r in mine.items()}
    e2e = {k: r["e2e_seconds"] for k, r in mine.items()}
    row = {
        "task": task, "method": method, "n": len(rs),
        "new_tokens_mean": sum(r["new_tokens"] for r in rs) / len(rs),
        "e2e_seconds_total": sum(e2e.values()),
        "decode_tokens_per_s": metrics.summarize(v for v in tps.values() if v is not None),
        "decode_speedup": None, "e2e_speedup": None, "tau": None, "draft_share": None,
        "match_rate": metrics.match_rate(r.get("match_ar") for r in rs) if method != "ar" else None,
        "accept_hist": None, "position_rate": None, "position_accepted": None, "position_trials": None,
        "step_ms": None,
    }
    if method != "ar":
        ar_tps = {k: r["decode_tokens_per_s"] for k, r in ar.items()}
        ar_e2e = {k: r["e2e_seconds"] for k, r in ar.items()}
        if all(v is not None for v in tps.values()):
            row["decode_speedup"] = metrics.throughput_speedup(tps, ar_tps)
        row["e2e_speedup"] = metrics.time_speedup(e2e, ar_e2e)
    if rs[0].get("llamacpp"):  # llama.cpp's own drafting counters (llamacpp-dflash*): its mean acceptance length
        c = {k: sum(r["llamacpp"][k] for r in rs) for k in ("drafted", "accepted", "verify_steps")}
        row["tau"] = 1 + c["accepted"] / c["verify_steps"] if c["verify_steps"] else None
        row["llamacpp"] = dict(c, accept_rate=c["accepted"] / c["drafted"] if c["drafted"] else None,
                               plain_match_rate=metrics.match_rate(r.get("match_plain") for r in rs))
    if rs[0].get("tree_nodes") is not None:  # tree methods: candidate nodes verified per step (root excluded)
        nodes = [x for r in rs for x in r["tree_nodes"]]
        row["tree_nodes_mean"] = sum(nodes) / len(nodes) if nodes else None
        skips = [r["tree"]["draft_skips"] for r in rs if "draft_skips" in (r.get("tree") or {})]
        row["draft_skip_share"] = sum(skips) / len(nodes) if skips and nodes else None
    if rs[0]["accept_lengths"] is not None:
        # where a verify step's time goes: drafting, the target's verify forward (+ acceptance, cache crop and the
        # draft's context update), and the rest of the loop (stop checks, detokenisation, Python)
        steps = sum(len(r["accept_lengths"]) for r in rs)
        if steps:
            draft = sum(r["draft_seconds"] for r in rs)
            verify = sum(r["verify_seconds"] for r in rs)
            other = sum(r["decode_seconds"] for r in rs) - draft - verify
            row["step_ms"] = {"draft": 1e3 * draft / steps, "verify": 1e3 * verify / steps,
                              "other": 1e3 * other / steps, "total": 1e3 * (draft + verify + other) / steps,
                              "steps": steps}
        row["tau"] = metrics.pooled_tau(r["accept_lengths"] for r in rs)
        row["draft_share"] = metrics.share((r["draft_seconds"] for r in rs), (r["decode_seconds"] for r in rs))
        if drafts(method) and block_size:
            steps = [a for r in rs for a in r["accept_lengths"]]
            row["accept_hist"] = metrics.accept_length_histogram(steps, block_size)
            acc, tri = metrics.sum_position_counts((r["position_accepted"], r["position_trials"]) for r in rs)
            row["position_accepted"], row["position_trials"] = acc, tri
            row["position_rate"] = metrics.position_acceptance(acc, tri, block_size - 1)
    return row


# ------------------------------------------------------------------------------------------------------ report
def fmt_num(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def fmt_speedup(s: dict | None) -> str:
    if not s or s.get("median") is None:
        return "—"
    return f"{s['median']:.2f}× [{s['min']:.2f}–{s['max']:.2f}]"


def _section(title: str, caption: str, header: str, align: str, rows: list[str]) -> list[str]:
    """One report table: its heading, caption, header and rows, each block followed by a blank line."""
    return [title, "", caption, "", header, align, *rows, ""]


def render_report(results: dict) -> str:
    m = results["machine"]
    cfg = results["config"]
    lines = ["# blockdraft bench", "",
             f"- target: `{results['target']}` ({cfg['dtype']}), draft: `{results['draft']}`, "
             f"methods: {', '.join(results['methods'])}",
             f"- prompts: {'file ' + str(cfg['prompts']) if cfg['prompts'] else ', '.join(cfg['tasks'])}; "
             f"n={cfg['n']} per task, max_new_tokens={cfg['max_new_tokens']}, block_size={cfg['block_size'] or 'default'},"
             f" denoise_steps={cfg['denoise_steps']}, seed={cfg['seed']}, multi_turn={cfg['multi_turn']}",
             f"- machine: {m['cpu']} ({m['cpu_count']} CPUs, {m['threads']} torch threads"
             + (f"; {' '.join(m['cpu_flags'])}" if m.get("cpu_flags") else "")
             + (f"; {m['kernel_isa']} kernels" if m.get("kernel_isa") else "")
             + f"), torch {m['torch']}, transformers {m['transformers']}, {m['date']}",
             f"- command: `{results['command']}`",
             f"- wall time: {results['wall_seconds']:.1f} s", ""]
    for note in results["notes"]:
        lines.append(f"> note: {note}")
    if results["notes"]:
        lines.append("")
    lines += ["Speedups are paired per prompt against `ar` (same prompt, turn and temperature): decode = ratio of "
              "decode tokens/s (prefill and its token excluded), e2e = ratio of end-to-end generate time; "
              "median [min–max]. decode tok/s is the median over prompts. draft share = drafting time / decode "
              "time. match = share of prompts whose output tokens equal `ar`'s (bf16 kernels may flip near-ties; "
              "in fp32 greedy outputs are identical; at T>0 outputs are equal only in distribution).", ""]
    for tkey, block in results["summary"].items():
        temp = block["temperature"]
        lines += [f"## Temperature {tkey}", "",
                  "| task | method | n | tau | decode tok/s | decode speedup | e2e speedup | draft share | match |",
                  "|---|---|---:|---:|---:|---|---|---:|---:|"]
        for r in block["rows"]:
            match = "—" if r["match_rate"] is None or temp > 0 else f"{r['match_rate']:.0%}"
            share = "—" if r["draft_share"] is None or r["method"] == "ar" else f"{r['draft_share']:.0%}"
            lines.append(f"| {r['task']} | {r['method']} | {r['n']} | {fmt_num(r['tau'])} | "
                         f"{fmt_num((r['decode_tokens_per_s'] or {}).get('median'), '{:.1f}')} | "
                         f"{fmt_speedup(r['decode_speedup'])} | {fmt_speedup(r['e2e_speedup'])} | {share} | {match} |")
        lines.append("")
        for key, what, which in (("vs_llamacpp", "plain decoding", "plain methods"),
                                  ("vs_llamacpp_spec", "speculative decoding",
                                   "speculative methods with a draft model (`llamacpp-spec*`)")):
            vrows = [r for r in block["rows"] if r.get(key)]
            if vrows:
                lines += _section(f"### Against llama.cpp's {what} (T={tkey})",
                                  f"Decode tokens/s over that of the faster of llama.cpp's {which} in this run (by "
                                  "median), paired per prompt: median [min–max].",
                                  "| task | method | against | decode speedup |", "|---|---|---|---|",
                                  [f"| {r['task']} | {r['method']} | {r[key]['against']} | {fmt_speedup(r[key])} |"
                                   for r in vrows])
        lrows = [r for r in block["rows"] if r.get("llamacpp")]
        if lrows:
            lines += [f"### llama.cpp's speculative decoding (T={tkey})", "",
                      "llama.cpp's own counters: drafted and accepted tokens, verify steps; tau = 1 + accepted / "
                      "steps. plain match = share of prompts whose greedy output equals llama.cpp's plain output on "
                      "the same GGUF (`llamacpp` / `llamacpp-bf16` for our DFlash draft, `llamacpp-server` for a "
                      "draft model).", "",
                      "| task | method | drafted | accepted | steps | accept rate | tau | plain match |",
                      "|---|---|---:|---:|---:|---:|---:|---:|"]
            for r in lrows:
                c = r["llamacpp"]
                pm = "—" if c["plain_match_rate"] is None else f"{c['plain_match_rate']:.0%}"
                lines.append(f"| {r['task']} | {r['method']} | {c['drafted']} | {c['accepted']} | "
                             f"{c['verify_steps']} | {fmt_num(c['accept_rate'])} | {fmt_num(r['tau'])} | {pm} |")
            lines.append("")
        split = [r for r in block["rows"] if r["step_ms"] and r["task"] == ("all" if len(block["tasks"]) > 1
                                                                              else block["tasks"][0])]
        if split:
            lines += [f"### Per-step time split (T={tkey}, all tasks)", "",
                      "Mean milliseconds per verify step of the engine's methods; tokens per step = tau.", "",
                      "| method | steps | draft ms | verify ms | other ms | total ms | ms per token |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for r in split:
                sm = r["step_ms"]
                per_tok = sm["total"] / r["tau"] if r["tau"] else None
                lines.append(f"| {r['method']} | {sm['steps']} | {sm['draft']:.1f} | {sm['verify']:.1f} | "
                             f"{sm['other']:.1f} | {sm['total']:.1f} | {fmt_num(per_tok, '{:.1f}')} |")
            lines.append("")
        trows = [r for r in block["rows"] if r.get("tree_nodes_mean") is not None]
        if trows:
            lines += _section(f"### Tree verification (T={tkey})",
                              "Candidate nodes verified per step (the root excluded), tokens committed per step, and "
                              "the share of steps that verified lookup branches without running the draft.",
                              "| task | method | nodes per step | tau | draft skipped |", "|---|---|---:|---:|---:|",
                              [f"| {r['task']} | {r['method']} | {r['tree_nodes_mean']:.1f} | {fmt_num(r['tau'])} | "
                               f"{fmt_num(r.get('draft_skip_share'), '{:.0%}')} |" for r in trows])
        for meth in _drafting(r["method"] for r in block["rows"]):
            rows = [r for r in block["rows"] if r["method"] == meth and r["position_rate"] is not None]
            if not rows:
                continue
            npos = max(len(r["position_rate"]) for r in rows)
            lines += [f"### Per-position acceptance ({meth}, T={tkey})", "",
                      "Acceptance rate of draft position i (accepted / verified); — = never verified.", "",
                      "| task | " + " | ".join(str(i + 1) for i in range(npos)) + " |",
                      "|---|" + "---:|" * npos]
            for r in rows:
                lines.append(f"| {r['task']} | " + " | ".join(fmt_num(x) for x in r["position_rate"]) + " |")
            lines.append("")
    plots = [f for f in results["files"] if f.endswith(".png")]
    if plots:
        lines += ["## Plots", ""] + [f"![{f}]({f})" for f in plots] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- plots
def make_plots(summary: dict, methods: list[str], out_dir: Path) -> list[str]:
    """Speedup bars per task and method, accept-length histograms and per-position acceptance curves per task
    (for the drafting methods). Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for tkey, block in summary.items():
        rows = block["rows"]
        groups = list(dict.fromkeys(r["task"] for r in rows))
        others = [m for m in methods if m != "ar" and any(r["method"] == m for r in rows)]
        if others:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
            for ax, key, title in ((axes[0], "decode_speedup", "decode tok/s speedup vs ar"),
                                   (axes[1], "e2e_speedup", "end-to-end speedup vs ar")):
                def stat(g, m, key=key):
                    r = next((r for r in rows if r["task"] == g and r["method"] == m), None)
                    st = r[key] if r else None
                    return st if st and st.get("median") is not None else None

                present = [m for m in others if any(stat(g, m) for g in groups)]
                width = 0.8 / max(1, len(present))
                for j, m in enumerate(present):
                    xs, ys, lo, hi = [], [], [], []
                    for i, g in enumerate(groups):
                        st = stat(g, m)
                        if st:
                            xs.append(i + (j - (len(present) - 1) / 2) * width)
                            ys.append(st["median"])
                            lo.append(st["median"] - st["min"])
                            hi.append(st["max"] - st["median"])
                    ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=m, color=f"C{methods.index(m)}")
                ax.axhline(1.0, color="k", lw=0.8, ls="--")
                ax.set_xticks(range(len(groups)), groups)
                ax.set_title(f"{title} (T={tkey})")
                ax.set_ylabel("median speedup [min–max]")
                if present:
                    ax.legend()
            files.append(_save(fig, out_dir, "speedup", tkey))
        for m in _drafting(r["method"] for r in rows):
            drows = [r for r in rows if r["method"] == m and r["accept_hist"] is not None]
            if not drows:
                continue
            fig, axes = plt.subplots(1, len(drows), figsize=(3.2 * len(drows), 3), squeeze=False)
            for ax, r in zip(axes[0], drows):
                h = r["accept_hist"]
                tot = sum(h) or 1
                ax.bar(range(1, len(h) + 1), [c / tot for c in h])
                ax.set_title(f"{r['task']} (tau {r['tau']:.2f})")
                ax.set_xlabel("tokens committed per step")
            axes[0][0].set_ylabel("share of verify steps")
            fig.suptitle(f"accept lengths, {m}, T={tkey}")
            files.append(_save(fig, out_dir, f"accept_hist_{m}", tkey))

            fig, ax = plt.subplots(figsize=(6, 3.5))
            for r in drows:
                rate = [math.nan if x is None else x for x in r["position_rate"]]
                ax.plot(range(1, len(rate) + 1), rate, marker="o", ms=3, label=r["task"])
            ax.set_xlabel("draft position")
            ax.set_ylabel("acceptance rate")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"per-position acceptance, {m}, T={tkey}")
            ax.legend()
            files.append(_save(fig, out_dir, f"position_accept_{m}", tkey))
    return files


def _save(fig, out_dir: Path, stem: str, tkey) -> str:
    """Write a figure as `{stem}_T{tkey}.png` in out_dir, close it, return the file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    name = f"{stem}_T{tkey}.png"
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return name
