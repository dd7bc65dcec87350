"""`python -m benchmarks.report [DIR]`: the committed results read against the core issue's goals, as markdown."""

import json
import sys
from collections import defaultdict
from pathlib import Path


def load(path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else []


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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "benchmarks/results")
    parts = [ppl_section(load(out / "stream_ppl.json"), "stream_ppl"),
             ppl_section(load(out / "stream_ppl_64k" / "stream_ppl.json"), "stream_ppl (64K tokens)"),
             retrieval_section(load(out / "retrieval.json")), latency_section(load(out / "latency.json"))]
    print("\n".join(parts))


if __name__ == "__main__":
    main()
