"""torch._grouped_mm (CUTLASS's grouped GEMM on Hopper) against one cuBLAS matmul per expert, for the six GEMMs of
an experts layer's forward and backward (issue 3: the GEMMs set the pace; would per-expert cuBLAS calls be faster
where the experts are few and large?). The per-expert loop needs each expert's row count on the host (a host
synchronization the op avoids); here the counts are read once, outside the timing.

Each GEMM: median ms over --iters runs (CUDA events, the GPU idle before each), TFLOP/s, and whether the two
results are bitwise equal.

    python benchmarks/probes/cublas_loop_probe.py --shape mixtral [--tokens 8192]

``six_gemms`` builds the six GEMMs with each provider for other probes (goal_floor_probe.py adds the MegaKernel's
Triton GEMMs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

GEMMS = ("up", "down", "grad_act", "grad_input", "wgrad_up", "wgrad_down")


def six_gemms(H, I, E, K, tokens, dev="cuda", dtype=torch.bfloat16, triton=False):
    """The six GEMMs of a layer's forward and backward on random expert-sorted operands (the bench's routing):
    ({name: (flops, {provider: call(out)}, output shape)}, each expert's row count). Providers: "grouped_mm"
    (torch._grouped_mm, whose call ignores ``out``), "cublas_loop" (one torch.mm per expert into ``out``) and,
    with ``triton``, "triton" (the MegaKernel's Triton GEMM into ``out``, with the GPU heuristics' tile knobs
    for this shape and its library knobs off)."""
    import bench_moe_layer as bench

    _, ids, _, _ = bench.make_inputs(H, I, E, K, tokens, dtype, dev)
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

    def grouped(a, b):
        return lambda out: torch._grouped_mm(a, b, offs=offs)

    # name: (flops, grouped operands, per-expert call, output shape): the HF layouts, as the op runs them
    up_w, down_w = w13.transpose(-2, -1), w2.transpose(-2, -1)
    gemms = {
        "up": (2 * rows * H * 2 * I, grouped(x, up_w), rows_loop(x, up_w), (rows, 2 * I)),
        "down": (2 * rows * I * H, grouped(act, down_w), rows_loop(act, down_w), (rows, H)),
        "grad_act": (2 * rows * H * I, grouped(dy, w2), rows_loop(dy, w2), (rows, I)),
        "grad_input": (2 * rows * 2 * I * H, grouped(dh, w13), rows_loop(dh, w13), (rows, H)),
        "wgrad_up": (2 * rows * 2 * I * H, grouped(dh.t(), x), wgrad_loop(dh, x), (E, 2 * I, H)),
        "wgrad_down": (2 * rows * H * I, grouped(dy.t(), act), wgrad_loop(dy, act), (E, H, I)),
    }
    out = {name: (flops, {"grouped_mm": grouped_call, "cublas_loop": loop}, shape)
           for name, (flops, grouped_call, loop, shape) in gemms.items()}
    if triton:
        for name, call in _triton_gemms(H, I, E, K, ids, x, w13, w2, act, dy, dh).items():
            out[name][1]["triton"] = call
    return out, counts.tolist()


def _triton_gemms(H, I, E, K, ids, x, w13, w2, act, dy, dh):
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_gemm import STORE
    from uniep_dynamo.kernels.triton_routing import routing_plan
    from uniep_dynamo.spec import ExpertsSpec

    hidden = torch.empty(ids.shape[0], H, device=x.device, dtype=x.dtype)
    layer = megakernel.Layer(hidden, ids, w13, w2, ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), x.dtype))
    cfg = {name: dataclasses.replace(getattr(layer.config, name), grouped_mm=False, per_expert_mm=False)
           for name in GEMMS}
    _, _, offsets = routing_plan(ids, E, clamp=False)

    def rows(name, a, b, n, k):
        return lambda out: megakernel.rows_gemm(layer, cfg[name], a=a, gather=False, row_order=None, b=b, n=n, k=k,
                                                epilogue=STORE, c=out, offsets=offsets)

    def wgrad(name, p, q):  # grad[e] ([E, out, in], "oi": dims 2, 1) = q's rows of e transposed @ p's rows of e
        return lambda out: megakernel.weight_grad(layer, cfg[name], p=p, p_gather=False, q=q, q_gather=False,
                                                  q_scale=False, row_order=None, w=None, offsets=offsets, grad=out,
                                                  m_dim=2, n_dim=1)

    return {"up": rows("up", x, layer.up_eff, 2 * I, H), "down": rows("down", act, layer.down_eff, H, I),
            "grad_act": rows("grad_act", dy, layer.down_eff.transpose(1, 2), I, H),
            "grad_input": rows("grad_input", dh, layer.up_eff.transpose(1, 2), H, 2 * I),
            "wgrad_up": wgrad("wgrad_up", x, dh), "wgrad_down": wgrad("wgrad_down", act, dy)}


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
    gemms, counts = six_gemms(H, I, E, K, args.tokens, dev, dtype)
    result = {"shape": args.shape, "tokens": args.tokens, "gpu": torch.cuda.get_device_name(0),
              "rows_per_expert": counts if E <= 16 else [min(counts), max(counts)], "gemms": {}}
    total_g = total_c = 0.0
    print(f"{'gemm':12s} {'grouped_mm ms':>14s} {'TF/s':>7s} {'cuBLAS loop ms':>15s} {'TF/s':>7s} {'ratio':>6s} bitwise")
    for name, (flops, calls, shape) in gemms.items():
        grouped, loop = calls["grouped_mm"], calls["cublas_loop"]
        out = torch.empty(shape, device=dev, dtype=dtype)
        ms_g = time_cuda(lambda: grouped(None), args.iters, 3)
        ms_c = time_cuda(lambda: loop(out), args.iters, 3)
        same = torch.equal(grouped(None), (loop(out), out)[1])
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
