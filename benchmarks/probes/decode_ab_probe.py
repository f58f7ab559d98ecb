"""Decode steps of one HF model compiled by inductor and by uniep, timed in interleaved rounds in one process, with the
experts op's CUDA graphs (kernels/op_graphs.py) on and off on the same compiled uniep model (UNIEP_OP_GRAPHS is read
at each call). Rows of separate processes, or one backend after another, moved by 20-40% between runs on the GPU
hosts (2026-11-29); interleaving puts every variant under the same host conditions. Median ms a synchronized decode
forward (a token a sequence, static cache), per variant, over the rounds' medians. ``--prefill``: the prefill forward
instead (the whole prompt into a new static cache, as prefill_probe.py times it), whose experts calls take the op's
graphs up to op_graphs.MAX_SLOTS routed slots.

    python benchmarks/probes/decode_ab_probe.py --layers 2 --batch 8 --prompt-tokens 128 --rounds 6 --iters 20
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_train_step import MODELS, build  # noqa: E402
from prefill_probe import decode, prefill  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--prefill", action="store_true", help="time the prefill forward instead of a decode step")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_ab_probe.json"))
    args = parser.parse_args()
    import uniep_dynamo  # noqa: F401
    from torch._dynamo.utils import counters

    vocab = MODELS[args.model][1]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.prompt_tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    calls = 3 + 2 * args.rounds * args.iters + 8  # every decode call of one model (each advances a 5.2x cache)
    runs = {}
    for backend in ("inductor", "uniep"):
        model = build(args.model, args.layers, args.prompt_tokens + calls + 8, torch.bfloat16).eval()
        model.forward = torch.compile(model.forward, backend=backend)
        runs[backend] = prefill(model, ids, args.prompt_tokens + 8) if args.prefill else \
            decode(model, ids, args.prompt_tokens + calls + 8)
    variants = {"inductor": ("inductor", "1"), "uniep": ("uniep", "1"), "uniep, UNIEP_OP_GRAPHS=0": ("uniep", "0")}
    times = {name: [] for name in variants}
    with torch.no_grad():
        for run in runs.values():
            for _ in range(3):
                run()
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for name, (backend, graphs) in variants.items():
                os.environ["UNIEP_OP_GRAPHS"] = graphs
                walls = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    runs[backend]()
                    torch.cuda.synchronize()
                    walls.append(time.perf_counter() - t0)
                times[name].append(statistics.median(walls) * 1e3)
    os.environ.pop("UNIEP_OP_GRAPHS")
    rows = {name: {"median_ms": round(statistics.median(t), 3), "rounds_ms": [round(x, 3) for x in t]}
            for name, t in times.items()}
    for name, row in rows.items():
        print(f"{name:28s} {row['median_ms']:7.3f} ms   rounds {row['rounds_ms']}")
    from uniep_dynamo.kernels import op_graphs
    held = {"graphs": len(op_graphs._GRAPHS), "estimated_mb": round(op_graphs._BYTES[0] / 2**20, 1),
            "reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1)}
    print(json.dumps({"uniep_kernels": dict(counters["uniep_kernels"]), "op_graphs": held}))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": rows,
                   "uniep_kernels": dict(counters["uniep_kernels"]), "op_graphs": held}, f, indent=1)


if __name__ == "__main__":
    main()
