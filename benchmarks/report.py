"""`python -m benchmarks.report [DIR]`: the committed results read against the core issue's goals, as markdown.

`python -m benchmarks.report arena|video_qa [FILE] [--readme README]`: that benchmark's tables from its
JSON (default benchmarks/results/NAME.json); with `--readme`, written between that file's
`<!-- NAME:begin -->` and `<!-- NAME:end -->` lines instead of printed.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from streaming.records import read

from .arena_scores import BENCHMARKS, GOAL, QUALITY, best_at


def load(path):
    return read(path) if Path(path).exists() else []


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ppl_section(records, title):
    if not records:
        return f"### {title}\n\n(no results)\n"
    summary = [r for r in records if r["metric"] == "ppl" and isinstance(r["x"], str)]
    full = {r["x"]: r["value"] for r in summary if r["policy"] == "full"}
    head_key = next((k for k in full if k.startswith("0-")), None)
    rows = []
    for r in sorted(summary, key=lambda r: (str(r["budget"]), r["policy"], r["x"])):
        if r["x"] == head_key:
            alls = [s["value"] for s in summary if s["policy"] == r["policy"] and s["budget"] == r["budget"]
                    and s["x"] == "all"]
            share = [s["value"] for s in records if s["policy"] == r["policy"] and s["budget"] == r["budget"]
                     and s["metric"] == "evict_share" and s["x"] == "all"]
            rows.append([r["policy"], r["budget"], f"{r['value']:.2f}", f"{r['value'] / full[head_key]:.3f}",
                         f"{alls[0]:.2f}" if alls else "-", f"{share[0]:.3f}" if share else "-"])
    return (f"### {title}\n\n" + table(["policy", "budget", f"ppl {head_key}", "÷ full", "ppl whole stream",
                                        "evict share (upper bound)"], rows) + "\n")


def retrieval_section(records):
    if not records:
        return "### retrieval\n\n(no results)\n"
    buckets = list(dict.fromkeys(r["x"] for r in records))
    cells = defaultdict(dict)
    for r in records:
        cells[(r["policy"], r["budget"])][r["x"]] = r["value"]
    rows = [[p, b] + [f"{v[x]:.2f}" if x in v else "-" for x in buckets] for (p, b), v in cells.items()]
    return "### retrieval (accuracy by token distance)\n\n" + table(["policy", "budget", *buckets], rows) + "\n"


def latency_section(records):
    if not records:
        return "### latency\n\n(no results)\n"
    by = defaultdict(dict)
    for r in records:
        by[(r["policy"], r["metric"])][r["x"]] = r["value"]
    rows = []
    policies = list(dict.fromkeys(r["policy"] for r in records))
    for p in policies:
        dec, ttft = by[(p, "decode_ms_per_token")], by[(p, "ttft_s")]
        xs = sorted(dec)
        lo, hi = xs[0], xs[-1]
        kv = by[(p, "kv_mb")]
        rows.append([p, hi, f"{dec[lo]:.1f}", f"{dec[hi]:.1f}", f"{dec[hi] / dec[lo]:.2f}", f"{ttft[lo]:.3f}",
                     f"{ttft[hi]:.3f}", f"{ttft[hi] / ttft[lo]:.2f}", f"{kv[lo]:.1f} → {kv[hi]:.1f}",
                     f"{by[(p, 'evict_share')][hi]:.3f}", f"{by[(p, 'tokens_per_s')][hi]:.2f}"])
    text = "### latency (medians; first vs last checkpoint)\n\n" + table(
        ["policy", "last x", "decode ms first", "decode ms last", "ratio", "ttft first", "ttft last", "ratio",
         "KV MB", "evict share", "tok/s last"], rows) + "\n"
    tps = {p: by[(p, "tokens_per_s")] for p in policies}
    if "h2o" in tps:
        for p in ("inf_mllm", "inf_mllm_plus"):
            if p in tps:
                common = sorted(set(tps[p]) & set(tps["h2o"]))
                ratios = ", ".join(f"{x}: {tps[p][x] / tps['h2o'][x]:.2f}×" for x in common)
                text += f"\n{p} decode tokens/s ÷ h2o: {ratios}\n"
    return text


def _cell(value, spec, ratio=None, count=None):
    if value is None:
        return "-"
    text = format(value, spec)
    if ratio is not None:
        text += f" ({ratio:.2f})"
    if count is not None:
        text += f" [{int(count)}]"
    return text


def arena_section(path) -> str:
    """The arena's table: per (policy, budget), each benchmark's quality with its fraction of the full
    cache's in brackets, time per round, peak KV MB and eviction share; then the best configuration at
    1/8 of the context, read against the goal."""
    path = Path(path)
    records = load(path)
    settings_path = path.with_name(path.name.replace(".json", ".settings.json"))
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    if not records:
        return f"### arena\n\n(no results in {path})\n"
    benchmarks = [b for b in settings.get("benchmarks", BENCHMARKS) if any(r["benchmark"] == b for r in records)]
    value = {(r["benchmark"], r["policy"], r["budget"], r["metric"], r["x"]): r["value"] for r in records}
    scale = settings.get("scale", {})
    context = scale.get("context")
    used = ", ".join(f"{b} {int(value[(b, 'full', None, 'kv_tokens', 'context')])}" for b in benchmarks
                     if (b, "full", None, "kv_tokens", "context") in value)
    lines = [f"From `{path}`. Context C = {context} tokens (the full cache's length at the end of a stream: {used}); "
             f"budgets {', '.join(str(b) for b in settings.get('budgets', []))}. Cells: quality (÷ full cache)"
             " [questions]; per benchmark in the order " + " · ".join(benchmarks) + " for the last three columns.",
             ""]
    header = ["policy", "budget"]
    for b in benchmarks:
        metric, x, _ = QUALITY[b]
        header.append(f"{b} {metric} ({x})")
        if b == "retrieval":
            header.append("retrieval accuracy (all)")
    header += ["ms / round", "KV MB (peak)", "evict share"]
    keys = list(dict.fromkeys((r["policy"], r["budget"]) for r in records if r["metric"] == "round_ms"))
    keys.sort(key=lambda k: (k[1] is not None, k[1] or 0))
    rows = []
    for policy, budget in keys:
        row = [policy, "full" if budget is None else budget]
        for b in benchmarks:
            metric, x, _ = QUALITY[b]
            spec = ".2f" if metric == "ppl" else ".3f"
            if budget is None and x == "within budget":  # the full cache, on each budget's questions
                row.append(" · ".join(f"<{bb}: " + _cell(value.get((b, policy, None, metric, f"within {bb}")), spec,
                                                          count=value.get((b, policy, None, "questions",
                                                                           f"within {bb}")))
                                      for bb in settings.get("budgets", [])))
            else:
                row.append(_cell(value.get((b, policy, budget, metric, x)), spec,
                                 value.get((b, policy, budget, "of_full", x)),
                                 value.get((b, policy, budget, "questions", x))))
            if b == "retrieval":
                row.append(_cell(value.get((b, policy, budget, "accuracy", "all")), ".3f",
                                 value.get((b, policy, budget, "of_full", "all"))))
        for metric, x, spec in (("round_ms", "median", ".0f"), ("kv_mb", "peak", ".1f"),
                                ("evict_share", "median", ".3f")):
            row.append(" · ".join(_cell(value.get((b, policy, budget, metric, x)), spec) for b in benchmarks))
        rows.append(row)
    lines.append(table(header, rows))
    eighth = context // 8 if context else None
    if eighth in settings.get("budgets", []):
        goal_benchmarks = [b for b in ("retrieval", "video_qa") if b in benchmarks]
        best = best_at(records, eighth, goal_benchmarks) if goal_benchmarks else None
        if best:
            policy, got = best
            met = all(v >= GOAL for v in got.values())
            asked = {b: value.get((b, policy, eighth, "questions", QUALITY[b][1])) for b in goal_benchmarks}
            parts = ", ".join(f"{b} {got[b]:.1%} of full" + (f" on {int(asked[b])} questions" if asked[b] else "")
                              for b in goal_benchmarks)
            ppl = value.get(("stream_ppl", policy, eighth, "of_full", "stream"))
            lines += ["", f"Best configuration at 1/8 of the context (budget {eighth}): **{policy}** — {parts}"
                      + (f"; stream_ppl {ppl:.1%} of full (full ppl ÷ its ppl)" if ppl is not None else "")
                      + f". Goal ≥ {GOAL:.0%} on {' and '.join(goal_benchmarks)}: "
                      + ("**met**." if met else "**not met**.")]
    for kind in ("skipped", "failed"):
        for name, why in settings.get(kind, {}).items():
            lines.append(f"\n{kind}: {name} ({why})")
    return "### arena\n\n" + "\n".join(lines) + "\n"


def video_qa_section(path) -> str:
    """video_qa's two tables: accuracy by video length and by how far back the named clip is (with
    recall's share of evicted clips linked back), then time to first token and memory; per-round values
    exist for the longest video only."""
    records = load(path)
    if not records:
        return f"### video_qa\n\n(no results in {path})\n"
    value = {(r["policy"], r["metric"], r["x"]): r["value"] for r in records}
    per_round = defaultdict(dict)  # (policy, metric) → {round: value}, the longest video's rounds
    for r in records:
        if isinstance(r["x"], int) and r["metric"] in ("ttft_s", "kv_mb", "rss_mb"):
            per_round[(r["policy"], r["metric"])][r["x"]] = r["value"]
    lengths = sorted({r["x"] for r in records if r["metric"] == "accuracy" and isinstance(r["x"], int)})
    longest = lengths[-1]
    policies = list(dict.fromkeys(r["policy"] for r in records))
    backs = ["0", "1-4", "8-16", "32-64", "128-256"]

    def cell(policy, metric, x, spec=".3f"):
        return _cell(value.get((policy, metric, x)), spec)

    accuracy = [[p, *(cell(p, "accuracy", n) for n in lengths),
                 *(cell(p, "accuracy", f"{longest}r back {b}", ".2f") for b in backs),
                 cell(p, "accuracy", f"{longest}r evicted"), cell(p, "recall_at_k", f"{longest}r evicted", ".2f"),
                 cell(p, "oom_round", longest, ".0f") if (p, "oom_round", longest) in value else "–",
                 cell(p, "ingest_speed", longest, ".1f")] for p in policies]
    times = []
    for p in policies:
        ttft, kv, rss = (per_round[(p, m)] for m in ("ttft_s", "kv_mb", "rss_mb"))
        if not ttft:
            continue
        first = float(np.median([v for x, v in ttft.items() if x <= 10]))
        tail = value.get((p, "ttft_s", f"{longest}r rounds {longest - 9}-{longest}"))
        last = max(ttft)
        times.append([p, *(cell(p, "ttft_s", f"{n}r round {n}") for n in lengths if n <= 10), f"{first:.3f}",
                      _cell(tail, ".3f"), _cell(tail / first if tail else None, ".2f"),
                      cell(p, "ttft_s", f"{longest}r round {longest}"), cell(p, "ttft_s", f"{longest}r all rounds"),
                      f"{kv.get(10, float('nan')):.1f} → {kv[last]:.1f}"
                      + (f" (round {last})" if last < longest else ""),
                      f"{rss[last]:.0f}"])
    short = [f"round {n} of the {n}-round videos" for n in lengths if n <= 10]
    orin = orin_table(Path(path).with_name("video_qa_orin.json"))
    return ("### video_qa\n\nAccuracy (`evicted`: the questions whose "
            "clip had left the cache when asked; recall@k: the share of those whose clip was linked back):\n\n"
            + table(["policy", *(f"{n} rounds" for n in lengths), *(f"back {b}" for b in backs), "evicted",
                     "recall@k", "OOM round", f"ingest × real time ({longest} r)"], accuracy)
            + f"\n\nTime to first token (s, medians) and memory, {longest}-round video unless named:\n\n"
            + table(["policy", *short, "rounds 1–10", f"rounds {longest - 9}–{longest}", "ratio", f"round {longest}",
                     "all rounds", f"KV MB round 10 → {longest}", "RSS MB at the end"], times) + "\n"
            + (f"\nOrin demo protocol (`video_qa_orin.json`):\n\n{orin}\n" if orin else ""))


def orin_table(path) -> str:
    """The looped real clip: memory and time to first token at the first and last questions."""
    records = load(path)
    rows = []
    for policy in dict.fromkeys(r["policy"] for r in records):
        series = {m: [(r["x"], r["value"]) for r in records if r["policy"] == policy and r["metric"] == m
                      and not isinstance(r["x"], str)] for m in ("kv_mb", "kv_tokens", "rss_mb", "ttft_s")}
        ttft = [v for _, v in sorted(series["ttft_s"])]
        if not ttft:
            continue
        minutes, kv = max(series["kv_mb"])
        speed = next((r["value"] for r in records if r["policy"] == policy and r["metric"] == "ingest_speed"), None)
        rows.append([policy, f"{kv:.1f} MB at {minutes:.0f} min", f"{max(series['kv_tokens'])[1]:,.0f}",
                     f"{min(series['rss_mb'])[1]:.0f} → {max(series['rss_mb'])[1]:.0f} MB",
                     f"{np.median(ttft[:5]):.3f} → {np.median(ttft[-5:]):.3f} s", _cell(speed, ".1f")])
    return table(["policy", "KV at the end", "KV tokens", "RSS first → last question",
                  "TTFT first 5 → last 5 questions (median)", "ingest × real time"], rows) if rows else ""


SECTIONS = {"arena": arena_section, "video_qa": video_qa_section}


def write_readme(readme, section: str, name: str = "arena") -> None:
    """Put `section` between the README's marks for `name` (kept), replacing what was there."""
    path = Path(readme)
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} … {end} lines to write the {name} tables between")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{section}{end}{tail}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SECTIONS:
        name, args = argv[0], argv[1:]
        readme = None
        if "--readme" in args:
            i = args.index("--readme")
            readme, args = args[i + 1], args[:i] + args[i + 2:]
        path = Path(args[0] if args else f"benchmarks/results/{name}.json")
        section = SECTIONS[name](path / f"{name}.json" if path.is_dir() else path)
        if readme:
            write_readme(readme, section, name)
        else:
            print(section)
        return
    out = Path(argv[0] if argv else "benchmarks/results")
    parts = [ppl_section(load(out / "stream_ppl.json"), "stream_ppl"),
             ppl_section(load(out / "stream_ppl_64k" / "stream_ppl.json"), "stream_ppl (64K tokens)"),
             retrieval_section(load(out / "retrieval.json")), latency_section(load(out / "latency.json"))]
    print("\n".join(parts))


if __name__ == "__main__":
    main()
