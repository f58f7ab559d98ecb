"""Where a synchronized single-GPU experts step leaves the GPU idle (issue 3: uniep's synchronized step loses more
to the host than its back-to-back step does).

For each provider of bench_moe_layer.py (default: the sort + _grouped_mm baseline under inductor and uniep), one
shape: the step's synchronized time by CUDA events (median), its GPU kernel time (the union of the kernels'
intervals in a profiled step), the idle time between the step's first and last kernel, the host time from the
step's start to its first kernel launch, and the largest idle gaps with the kernels on either side and the host
calls that ran during them. Writes the profiled step's chrome trace (gzipped) to --out-dir.

    python benchmarks/probes/step_gaps_probe.py --shape qwen3-30b-a3b [--providers sort_grouped_mm_inductor,uniep]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _kernels_and_host(trace_path):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda k: k[0])
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")),
                  key=lambda k: k[0])
    return kernels, host


def analyse(trace_path, step_start_host, top):
    kernels, host = _kernels_and_host(trace_path)
    busy, gaps, end = 0.0, [], None
    for s, e, name in kernels:
        if end is None:
            busy, end, prev = e - s, e, name
            continue
        if s > end:
            gaps.append((s - end, end, s, prev, name))
            busy += e - s
        elif e > end:
            busy += e - end
        if e >= end:
            end, prev = e, name
    first, last = kernels[0][0], max(k[1] for k in kernels)
    out = {"kernels": len(kernels), "gpu_busy_us": round(busy, 1), "first_to_last_us": round(last - first, 1),
           "idle_us": round(sum(g[0] for g in gaps), 1),
           "host_start_to_first_kernel_us": round(first - step_start_host, 1) if step_start_host else None,
           "gaps": []}
    for width, s, e, before, after in sorted(gaps, reverse=True)[:top]:
        during = [n for hs, he, n in host if hs < e and he > s and he - hs > 0.3 * width]
        out["gaps"].append({"us": round(width, 1), "at_us": round(s - first, 1), "after": before[:80],
                            "before": after[:80], "host": sorted(set(during), key=during.index)[:8]})
    return out


def main():
    import bench_moe_layer as bench
    from torch.profiler import ProfilerActivity, profile, record_function

    from uniep_dynamo.tuner import time_cuda

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--providers", default="sort_grouped_mm_inductor,uniep")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    parser.add_argument("--cprofile", type=int, default=0,
                        help="also run each provider's step this many times under cProfile (synchronized) and print "
                             "the host functions by own time")
    args = parser.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    H, I, E, K = bench.SHAPES[args.shape]
    experts = bench.hf_experts(H, I, E, K, dtype, dev)
    x, ids, w, grad_out = bench.make_inputs(H, I, E, K, args.tokens, dtype, dev)
    provs = bench.providers(experts)
    # the same two under CUDA graphs (inductor's cudagraph trees), as mode="reduce-overhead" runs them
    graphed_sort = torch.compile(bench.sort_grouped_mm, mode="reduce-overhead")
    provs["sort_grouped_mm_cudagraphs"] = lambda x, ids, w: graphed_sort(x, ids, w, experts.gate_up_proj,
                                                                         experts.down_proj)
    graphed_uniep = torch.compile(experts, backend="uniep", mode="reduce-overhead")
    provs["uniep_cudagraphs"] = lambda x, ids, w: graphed_uniep(x, ids, w)
    result = {}
    for name in args.providers.split(","):
        run = bench.step(provs[name], experts, x, ids, w, grad_out)
        for _ in range(3):
            run()
        ms = time_cuda(run, args.iters, 3)
        b2b = bench.time_cuda_back_to_back(run, args.iters)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
            for i in range(3):
                with record_function(f"step{i}"):
                    run()
                torch.cuda.synchronize()
        path = os.path.join(args.out_dir, f"step-gaps-{args.shape}-{name}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("ph") == "X" and e.get("name", "").startswith("step") and e.get("cat") == "user_annotation")
        # the second profiled step: its host events and its kernels (each step ends in a synchronization)
        s0, s1 = steps[1]
        s2 = steps[2][0]
        kept = [e for e in events if e.get("ph") != "X" or s0 - 1 <= e.get("ts", 0) < s2]
        with open(path, "w") as f:
            json.dump({"traceEvents": kept}, f)
        info = analyse(path, s0, args.top)
        info.update(sync_ms=round(ms, 3), back_to_back_ms=round(b2b, 3), host_step_us=round(s1 - s0, 1))
        result[name] = info
        if args.cprofile:
            import cProfile
            import io
            import pstats

            prof_host = cProfile.Profile()
            for _ in range(args.cprofile):
                prof_host.enable()
                run()
                prof_host.disable()
                torch.cuda.synchronize()
            text = io.StringIO()
            stats = pstats.Stats(prof_host, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumtime").print_stats(r"uniep_dynamo|bench_moe_layer", 40)
            print(f"## {name}: cProfile of {args.cprofile} steps (host only, synchronized after each)")
            print(text.getvalue())
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
        print(f"## {name}: synchronized {ms:.3f} ms, back to back {b2b:.3f} ms; profiled step: host {s1 - s0:.0f} us, "
              f"GPU busy {info['gpu_busy_us']:.0f} us of {info['first_to_last_us']:.0f} (idle {info['idle_us']:.0f}), "
              f"host start -> first kernel {info['host_start_to_first_kernel_us']} us, {info['kernels']} kernels")
        for g in info["gaps"]:
            print(f"  gap {g['us']:7.1f} us at {g['at_us']:8.1f}: after {g['after']!r} before {g['before']!r}; "
                  f"host: {g['host']}")
    with open(os.path.join(args.out_dir, f"step-gaps-{args.shape}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
