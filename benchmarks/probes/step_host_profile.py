"""Where the host time of one experts-layer step (forward + backward, bench_moe_layer.py's step) goes, on one GPU.

Each profiled step starts on an idle GPU (synchronized before it, outside the step), so no launch waits for the GPU
and cProfile's times are the host's own. Prints the step's host time against its GPU time (CUDA events, the same
steps without the profiler), then the functions with the most own (tottime) and cumulative time a step, and writes
both to $OUT/step_host_profile.json. A step is host-bound back to back when its host time exceeds its GPU time.

    python benchmarks/probes/step_host_profile.py --shape qwen3-30b-a3b --steps 20 [--provider uniep]
        [--callees _dgated_late,experts_forward] [--inference --tokens 32]

``--inference``: the forward alone under torch.no_grad() (bench_moe_layer.py --inference's step). The host calls that
synchronize with the GPU in one step are counted too (torch.cuda.set_sync_debug_mode("warn")'s warnings).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import SHAPES, hf_experts, make_inputs, providers, step  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--provider", default="uniep")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--callees", default="",
                        help="comma-separated function-name patterns: what each calls, with its times (pstats)")
    parser.add_argument("--inference", action="store_true", help="the forward alone under torch.no_grad()")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "step_host_profile.json"))
    args = parser.parse_args()
    H, I, E, K = SHAPES[args.shape]
    experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
    x, ids, w, grad_out = make_inputs(H, I, E, K, args.tokens, torch.bfloat16, "cuda")
    run = step(providers(experts)[args.provider], experts, x, ids, w, grad_out, args.inference)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (torch's notice that the debug mode is a prototype is a warning too: only the operations it flags count)
    syncs = [str(c.message).splitlines()[0][:160] for c in caught
             if "called a synchronizing CUDA operation" in str(c.message)]
    host, gpu = [], []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        run()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    host.sort()
    gpu.sort()
    prof = cProfile.Profile()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        prof.enable()
        run()
        prof.disable()
    torch.cuda.synchronize()
    data = {"device": torch.cuda.get_device_name(), "shape": args.shape, "T": args.tokens, "provider": args.provider,
            "inference": args.inference, "host_ms_median": round(host[len(host) // 2], 3),
            "gpu_ms_median": round(gpu[len(gpu) // 2], 3), "synchronizing_calls": syncs}
    print(f"# {data['device']} {args.shape} T={args.tokens} {args.provider}{' inference' if args.inference else ''}: "
          f"host {data['host_ms_median']} ms a step, GPU (start to end, synchronized) {data['gpu_ms_median']} ms, "
          f"{len(syncs)} synchronizing calls a step {syncs[:4]}")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(key).print_stats(args.top)
        text = buf.getvalue()
        data[key] = text
        print(f"## by {key} ({args.steps} steps)\n{text}")
    for pattern in filter(None, args.callees.split(",")):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_callees(pattern)
        data[f"callees:{pattern}"] = buf.getvalue()
        print(f"## callees of {pattern} ({args.steps} steps)\n{buf.getvalue()}")
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
