"""Why is generate()'s prefill slower compiled by uniep than by inductor (bench_generate.py, 2026-11-29)? One prefill
forward of an HF model at real dims (a static cache, the forward compiled as bench_generate.py compiles it), per
backend: its wall time against its kernels' time (profiler), the kernels with the most CUDA time, the host operations
with the most own time, and dynamo's graph count (a recompile or a graph break would show there).

    python benchmarks/probes/prefill_probe.py --model qwen3-30b-a3b --layers 2 --batch 8 --prompt-tokens 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_train_step import MODELS, build  # noqa: E402


def prefill(model, input_ids, cache_len):
    """One prefill forward into a new static cache (as generate() makes one; a cache written once is full: the
    model appends where its last call ended). The cache's allocation is inside the timed call."""
    from transformers import StaticCache

    def run():
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        return model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--backends", default="uniep,inductor,eager")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_probe.json"))
    args = parser.parse_args()
    import uniep_dynamo  # noqa: F401
    from torch._dynamo.utils import counters

    vocab = MODELS[args.model][1]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.prompt_tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    rows = []
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        counters.clear()
        model = build(args.model, args.layers, args.prompt_tokens + 8, torch.bfloat16).eval()
        if backend != "eager":
            model.forward = torch.compile(model.forward, backend=backend)
        run = prefill(model, ids, args.prompt_tokens + 8)
        with torch.no_grad():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            walls = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                run()
            end.record()
            torch.cuda.synchronize()
            b2b = start.elapsed_time(end) / args.iters
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
        events = prof.key_averages()
        # the kernels' own events only: a CPU op's self device time is its kernels' again
        cuda_total = sum(e.self_device_time_total for e in events
                         if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e3
        kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]
        row = {"backend": backend, "wall_ms_median": round(statistics.median(walls) * 1e3, 3),
               "back_to_back_ms": round(b2b, 3), "profiled_kernel_ms": round(cuda_total, 3),
               "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
               "uniep": dict(counters["uniep"]), "uniep_kernels": dict(counters["uniep_kernels"]),
               "kernels": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in kernels],
               "host": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in host]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "host")}), flush=True)
        print("  kernels (name, calls, self CUDA ms):")
        for k in row["kernels"]:
            print(f"    {k[2]:8.3f} {k[1]:4d}  {k[0]}")
        print("  host (name, calls, self CPU ms):")
        for k in row["host"]:
            print(f"    {k[2]:8.3f} {k[1]:4d}  {k[0]}")
        del model, run
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
