"""Why is generate()'s prefill slower compiled by uniep than by inductor (bench_generate.py, 2026-11-29)? One prefill
forward of an HF model at real dims (a static cache, the forward compiled as bench_generate.py compiles it), per
backend: its wall time against its kernels' time (profiler), the kernels with the most CUDA time, the host operations
with the most own time, and dynamo's graph count (a recompile or a graph break would show there).

    python benchmarks/probes/prefill_probe.py --model qwen3-30b-a3b --layers 2 --batch 8 --prompt-tokens 128

``--backends`` takes options after a colon (``uniep:rewrite_router=0+rewrite_experts=0``), and each row gives the host
time inside the uniep ops' bodies (``op_bodies_ms``, a call's share, from the synchronized loop). ``--decode`` times
one decode forward instead (one new token a sequence, after a prefill into the static cache), as generate() runs it
with the forward compiled in the default mode. Transformers 5.17 writes the step at the fixed
``cache_position`` given; from 5.2x the static cache advances its own length, so the cache has room for every
call. ``--cprofile N`` adds the Python functions with the most own time over N more calls (cProfile's overhead
inflates every number; the ranking is what it is for).
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


def decode(model, input_ids, cache_len):
    """One decode forward (a token a sequence) at a fixed position of a static cache that a prefill filled."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    step_ids = input_ids[:, -1:].contiguous()
    position = torch.tensor([input_ids.shape[1]], device=input_ids.device)

    def run():
        return model(step_ids, past_key_values=cache, use_cache=True, cache_position=position, logits_to_keep=1).logits

    return run


def timed_op_bodies():
    """Wrap the uniep ops' bodies (op_graphs.forward, megakernel.experts_forward, triton_router.router_forward) with
    host timers: returns (a one-element list of the seconds spent inside them, outermost calls only; a function that
    undoes the wrapping). The custom ops' dispatch around them is not in it."""
    from uniep_dynamo.kernels import megakernel, op_graphs, triton_router

    spent, depth, patched = [0.0], [0], []
    for module, name in ((op_graphs, "forward"), (megakernel, "experts_forward"), (triton_router, "router_forward")):
        real = getattr(module, name)

        def timed(*args, _real=real, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - t0

        setattr(module, name, timed)
        patched.append((module, name, real))

    def undo():
        for module, name, real in patched:
            setattr(module, name, real)

    return spent, undo


def python_profile(run, calls, top):
    """(function, calls, own ms, cumulative ms) of the Python functions with the most own time over ``calls`` calls."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", v[1], v[2] * 1e3 / calls, v[3] * 1e3 / calls)
                   for k, v in stats.items()), key=lambda r: -r[2])
    return [(name, n, round(own, 4), round(cum, 4)) for name, n, own, cum in rows[:top]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--backends", default="uniep,inductor,eager")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--decode", action="store_true", help="time a decode forward (a token a sequence)")
    parser.add_argument("--cprofile", type=int, default=0, help="Python functions by own time over N more calls")
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
        name, _, option_text = backend.partition(":")  # uniep:rewrite_router=0+rewrite_experts=0
        options = {k: bool(int(v)) for k, v in (o.split("=") for o in option_text.split("+") if o)}
        if name != "eager":
            model.forward = torch.compile(model.forward, backend=name, options=options or None)
        calls = 3 + 2 * args.iters + 1 + args.cprofile  # every call of run() below
        run = (decode if args.decode else prefill)(model, ids, args.prompt_tokens + 8 + (calls if args.decode else 0))
        with torch.no_grad():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            walls = []
            spent, undo = timed_op_bodies()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            undo()
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
            py = python_profile(run, args.cprofile, args.top * 2) if args.cprofile else []
        events = prof.key_averages()
        # the kernels' own events only: a CPU op's self device time is its kernels' again
        cuda_total = sum(e.self_device_time_total for e in events
                         if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e3
        kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]
        row = {"backend": backend, "wall_ms_median": round(statistics.median(walls) * 1e3, 3),
               "back_to_back_ms": round(b2b, 3),
               "op_bodies_ms": round(spent[0] * 1e3 / args.iters, 3), "profiled_kernel_ms": round(cuda_total, 3),
               "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
               "uniep": dict(counters["uniep"]), "uniep_kernels": dict(counters["uniep_kernels"]),
               "kernels": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in kernels],
               "host": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in host],
               "python": py}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "host", "python")}), flush=True)
        print("  kernels (name, calls, self CUDA ms):")
        for k in row["kernels"]:
            print(f"    {k[2]:8.3f} {k[1]:4d}  {k[0]}")
        print("  host (name, calls, self CPU ms):")
        for k in row["host"]:
            print(f"    {k[2]:8.3f} {k[1]:4d}  {k[0]}")
        if py:
            print("  Python (function, calls, own ms a call, cumulative ms a call; cProfile):")
            for name, n, own, cum in py:
                print(f"    {own:8.4f} {cum:8.4f} {n:6d}  {name}")
        del model, run
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
