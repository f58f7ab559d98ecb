"""torch._grouped_mm (CUTLASS's grouped GEMM on Hopper) against one cuBLAS matmul per expert, for the six GEMMs of
an experts layer's forward and backward (issue 3: the GEMMs set the pace; would per-expert cuBLAS calls be faster
where the experts are few and large?). The per-expert loop needs each expert's row count on the host (a host
synchronization the op avoids); here the counts are read once, outside the timing.

Each GEMM: median ms over --iters runs (CUDA events, the GPU idle before each), TFLOP/s, and whether the two
results are bitwise equal.

    python benchmarks/probes/cublas_loop_probe.py --shape mixtral [--tokens 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main():
    import bench_moe_layer as bench

    from uniep_dynamo.tuner import time_cuda

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="mixtral")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cublas_loop_probe.json"))
    args = parser.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    H, I, E, K = bench.SHAPES[args.shape]
    _, ids, _, _ = bench.make_inputs(H, I, E, K, args.tokens, dtype, dev)
    rows = ids.numel()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    bounds = [0] + offs.tolist()
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g) * 0.05

    x, w13, w2 = rnd(rows, H), rnd(E, 2 * I, H), rnd(E, H, I)
    act, dy, dh = rnd(rows, I), rnd(rows, H), rnd(rows, 2 * I)
    spans = list(enumerate(zip(bounds, bounds[1:])))

    def rows_loop(a, w):  # out rows of expert e = a's rows of e @ w[e]
        return lambda out: [torch.mm(a[lo:hi], w[e], out=out[lo:hi]) for e, (lo, hi) in spans]

    def wgrad_loop(p, q):  # out[e] = p's rows of e transposed @ q's rows of e
        return lambda out: [torch.mm(p[lo:hi].t(), q[lo:hi], out=out[e]) for e, (lo, hi) in spans]

    # name: (flops, grouped call, per-expert call, output shape): the HF layouts, as the op runs them
    up_w, down_w = w13.transpose(-2, -1), w2.transpose(-2, -1)
    gemms = {
        "up": (2 * rows * H * 2 * I, lambda: torch._grouped_mm(x, up_w, offs=offs), rows_loop(x, up_w), (rows, 2 * I)),
        "down": (2 * rows * I * H, lambda: torch._grouped_mm(act, down_w, offs=offs), rows_loop(act, down_w), (rows, H)),
        "grad_act": (2 * rows * H * I, lambda: torch._grouped_mm(dy, w2, offs=offs), rows_loop(dy, w2), (rows, I)),
        "grad_input": (2 * rows * 2 * I * H, lambda: torch._grouped_mm(dh, w13, offs=offs), rows_loop(dh, w13),
                       (rows, H)),
        "wgrad_up": (2 * rows * 2 * I * H, lambda: torch._grouped_mm(dh.t(), x, offs=offs), wgrad_loop(dh, x),
                     (E, 2 * I, H)),
        "wgrad_down": (2 * rows * H * I, lambda: torch._grouped_mm(dy.t(), act, offs=offs), wgrad_loop(dy, act),
                       (E, H, I)),
    }
    result = {"shape": args.shape, "tokens": args.tokens, "gpu": torch.cuda.get_device_name(0),
              "rows_per_expert": counts.tolist() if E <= 16 else [min(counts.tolist()), max(counts.tolist())],
              "gemms": {}}
    total_g = total_c = 0.0
    print(f"{'gemm':12s} {'grouped_mm ms':>14s} {'TF/s':>7s} {'cuBLAS loop ms':>15s} {'TF/s':>7s} {'ratio':>6s} bitwise")
    for name, (flops, grouped, loop, shape) in gemms.items():
        out = torch.empty(shape, device=dev, dtype=dtype)
        ms_g = time_cuda(grouped, args.iters, 3)
        ms_c = time_cuda(lambda: loop(out), args.iters, 3)
        same = torch.equal(grouped(), (loop(out), out)[1])
        total_g += ms_g
        total_c += ms_c
        result["gemms"][name] = {"grouped_mm_ms": round(ms_g, 4), "cublas_loop_ms": round(ms_c, 4),
                                 "grouped_tflops": round(flops / ms_g / 1e9, 1),
                                 "cublas_tflops": round(flops / ms_c / 1e9, 1), "bitwise_equal": same}
        print(f"{name:12s} {ms_g:14.4f} {flops / ms_g / 1e9:7.1f} {ms_c:15.4f} {flops / ms_c / 1e9:7.1f} "
              f"{ms_g / ms_c:6.3f} {same}")
    result.update(grouped_total_ms=round(total_g, 4), cublas_total_ms=round(total_c, 4))
    print(f"{'total':12s} {total_g:14.4f} {'':7s} {total_c:15.4f} {'':7s} {total_g / total_c:6.3f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
