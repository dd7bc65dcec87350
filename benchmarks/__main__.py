"""`python -m benchmarks NAME [--quick] [--out DIR]`: stream_ppl, retrieval, latency, tiny_vlm, video_qa, and
arena (every policy on stream_ppl, retrieval and video_qa at the same budgets), natural (plain-words questions
over an hour of real footage), prefill (a clip turn's prefill, LM head over every position against the last),
hf_models (transformers' video LLMs on the bounded cache, per family on a tiny random checkpoint), compiled_decode
(transformers' own caches, eager and compiled, as the decode reference), sdpa_backends (a GPU diagnostic), fingerprint
(what every policy path answers and keeps, to prove a change kept behaviour) and recall_path (recall's bookkeeping on
the model's thread at 1,000 stored spans), streams (many streams on one model: the session pool against one
lock), link_modes (a linked clip's KV reused, partly recomputed or re-encoded, on the same questions), link_time
(what linking costs per reuse mode as a clip's visual tokens grow), ingest (1 and 4 real-time streams' ingest speed
with the object detector), hostile (4 well-behaved server sessions' time to first token while the hostile
reliability rows run against the same server) and decode_ab (a lone session's and a pool's decode speed, this
checkout against `--old-tree`, interleaved), now (answers about the frames sent and about the present, through
stream-qa, the app's path, the server's native, chat-completions and Realtime routes), packed (clip turns of
several streams in one forward against one a round), watch (detector-backed watches over the natural hour:
precision, recall, latency, false alerts, the re-arm settings swept), watch_model (the same kinds as the model's
yes/no questions: precision, recall, the cache and answers against a stream without watches, 16 watches' cost),
watch_delivery (a stream's pace with its alerts handed to a 10-s webhook and to a broker that is gone), watch_kv (the
KV cache of a stream with 16 model watches over 1,000 clips against one with none), gate (the
change gate's measure on moving, still and entering footage; a still camera's and bikes.mp4's cost with it on and off),
perception_runtime (tiny-vlm's perception on ONNX Runtime against torch: CPU per stage, the same words), cpu_step (a
lone stream's decode step against its bandwidth floor and llama.cpp on the same GGUF, fp32 and bf16).
latency, hf_models, compiled_decode, sdpa_backends, streams and link_time take `--shape` (a randomly initialised
7B-sized model) and `--device`."""

import argparse
import importlib
import os
import sys

NAMES = ("stream_ppl", "retrieval", "latency", "prefill", "hf_models", "compiled_decode", "sdpa_backends",
         "static_cache", "tiny_vlm", "video_qa", "arena", "real_scenes", "perception", "natural", "fingerprint",
         "recall_path", "streams", "serve", "hf_template", "link_modes", "link_time", "ingest", "hostile", "decode_ab",
         "now", "packed", "watch", "watch_model", "watch_delivery", "watch_kv", "gate", "perception_runtime",
         "cpu_step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--quick", action="store_true", help="a short run (about two minutes on 2 cores)")
    parser.add_argument("--out", default="benchmarks/results", help="output folder (default: benchmarks/results)")
    parser.add_argument("--policies", nargs="*", help="subset of policies to run (perception: of its presets)")
    parser.add_argument("--tokens", type=int, help="override the streamed length (tiny_vlm: questions per setting)")
    parser.add_argument("--budgets", type=int, nargs="*",
                        help="override the budgets (stream_ppl, retrieval, arena; video_qa: the first)")
    parser.add_argument("--model", help="natural: another model (models.ADAPTERS, e.g. chat-univi-tiny: a model whose "
                        "turns carry no words, so the clip log holds only the object detector's)")
    parser.add_argument("--perception", help="tiny_vlm, real_scenes, natural: a tiny-vlm perception preset "
                        "(models/tiny_vlm/perception.py; default: the model's)")
    parser.add_argument("--resume", action="store_true",
                        help="stream_ppl: continue the run stopped in --out (checkpoints every 64K tokens); "
                             "arena: skip the runs already in --out/arena.json")
    parser.add_argument("--shape", help="a randomly initialised 7B-sized model instead of the small real one, for "
                        "speed and memory only (latency, compiled_decode, sdpa_backends, streams, link_time: "
                        "vicuna-7b, llama-2-7b-32k, or llama-tiny for a GPU script's dry run on a CPU; hf_models: 7b)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--rounds", type=int, help="latency: timed rounds per state (default 9; 3 with --quick); "
                        "link_time: timed questions per clip size (default 9); decode_ab: rounds per side (default 5); "
                        "packed: rounds per mode (default 5)")
    parser.add_argument("--old-tree", help="prefill, recall_path, decode_ab, now: also run the checkout in this folder "
                        "(e.g. `git worktree add DIR 57ad80a`, the commit before issue 23) in its own process, turn by "
                        "turn with the rest; fingerprint: compare this checkout's fingerprints with that one's")
    args = parser.parse_args(argv)
    if args.old_tree and not all(os.path.isdir(os.path.join(args.old_tree, d)) for d in ("models", "streaming")):
        parser.error(f"--old-tree {args.old_tree}: not a checkout of this project (no models/ or streaming/)")
    module = importlib.import_module(f"benchmarks.{args.name}")
    try:
        module.run(args)
    except KeyboardInterrupt:
        print("interrupted: results so far are in", args.out, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
