"""How far issue 3's speed goals are from what the GEMMs alone cost: for each shape, in one run, the strongest
baseline (stable sort + torch._grouped_mm + gather combine, under inductor) and uniep, fwd+bwd as
bench_moe_layer.py times them, then the layer's six GEMMs alone, each by the fastest of three kernels measured
here: torch._grouped_mm (CUTLASS), one cuBLAS matmul per expert, the MegaKernel's Triton GEMM (the GPU
heuristics' tiles). A layer cannot run faster than its GEMMs; where the six at their fastest take longer than
the goal allows (the baseline's time over the goal ratio), no fusion of the rest reaches the goal without a
faster GEMM kernel than these.

    python benchmarks/probes/goal_floor_probe.py --shapes qwen3-30b-a3b,olmoe,mixtral,deepseek-v3,qwen3-30b-a3b@32768

ms: median of --iters runs, CUDA events, the GPU idle before each. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# issue 3's goals: uniep's speedup over the strongest baseline, per shape (at any token count)
GOALS = {"mixtral": 1.2, "qwen3-30b-a3b": 1.6, "olmoe": 1.6, "deepseek-v3": 1.4}
BASELINE = "sort_grouped_mm_inductor"


def gemm_floor(H, I, E, K, tokens, iters) -> dict:
    """Each of the six GEMMs timed with every provider, the fastest kept; with their sum."""
    from cublas_loop_probe import six_gemms

    from uniep_dynamo.tuner import time_cuda

    gemms, counts = six_gemms(H, I, E, K, tokens, triton=True)
    out = {"rows_per_expert": [min(counts), max(counts)], "gemms": {}}
    for name, (flops, calls, shape) in gemms.items():
        buf = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        times = {p: round(time_cuda(lambda call=call: call(buf), iters, 3), 4) for p, call in calls.items()}
        best = min(times, key=times.get)
        out["gemms"][name] = {**{f"{p}_ms": ms for p, ms in times.items()}, "best": best,
                              "best_tflops": round(flops / times[best] / 1e9, 1)}
        print(json.dumps({name: out["gemms"][name]}), flush=True)
    out["best_ms"] = round(sum(g[f"{g['best']}_ms"] for g in out["gemms"].values()), 3)
    for p in next(iter(gemms.values()))[1]:
        out[f"{p}_ms"] = round(sum(g[f"{p}_ms"] for g in out["gemms"].values()), 3)
    return out


def main():
    import bench_moe_layer as bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe,mixtral,deepseek-v3,qwen3-30b-a3b@32768")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "goal_floor_probe.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("goal_floor_probe: needs a CUDA GPU")
    keep = {BASELINE, "uniep"}
    skip = tuple(p for p in ("hf_grouped_mm", "hf_grouped_mm_inductor", BASELINE, "liger_fused_moe", "uniep",
                             "uniep_reference") if p not in keep)
    rows = []
    for spec in args.shapes.split(","):
        name, _, tokens = spec.partition("@")
        T = int(tokens or args.tokens)
        H, I, E, K = bench.SHAPES[name]
        row = bench.bench_shape(name, T, args.iters, 3, torch.bfloat16, "cuda", skip=skip)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        row["gemm_floor"] = gemm_floor(H, I, E, K, T, 2 * args.iters)
        gc.collect()
        torch.cuda.empty_cache()
        row["goal"] = GOALS[name]
        row["goal_ms"] = round(row[f"{BASELINE}_ms"] / row["goal"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("ms, synchronized; the six GEMMs at the fastest of grouped_mm / cuBLAS per expert / Triton")
    print(f"{'shape':22s} {'baseline':>9s} {'uniep':>8s} {'ratio':>6s} {'goal':>5s} {'goal ms':>8s} "
          f"{'6 GEMMs':>8s} {'GEMMs/goal':>10s} {'uniep-GEMMs':>11s}  fastest kernel per GEMM")
    for row in rows:
        base, ours, floor = row[f"{BASELINE}_ms"], row["uniep_ms"], row["gemm_floor"]
        kinds = ",".join(g["best"] for g in floor["gemms"].values())
        print(f"{row['shape']:22s} {base:9.3f} {ours:8.3f} {base / ours:6.3f} {row['goal']:5.2f} {row['goal_ms']:8.3f} "
              f"{floor['best_ms']:8.3f} {floor['best_ms'] / row['goal_ms']:10.3f} {ours - floor['best_ms']:11.3f}  "
              f"{kinds}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
