"""Time each grouped GEMM of the MegaKernel alone over a list of tile configs (a manual tuning aid).

For each shape: the six GEMMs (forward up/down, backward grad_act/grad_input, weight gradients) are
launched on their real inputs with each candidate GemmConfig; prints the best per GEMM with TFLOP/s
and writes JSON. Configs that do not compile or run out of resources are reported and skipped.

    python benchmarks/sweep_megakernel.py --shapes mixtral,qwen3-30b-a3b
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_layer import SHAPES, make_inputs, time_cuda  # noqa: E402

CANDIDATES = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (64, 256, 64, 4, 3),
    (128, 128, 64, 8, 4), (64, 64, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 4), (128, 64, 64, 8, 4),
    (64, 128, 64, 4, 3), (256, 64, 64, 8, 3), (128, 128, 64, 8, 5),
]


def main():
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.config import GemmConfig
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_routing import routing_plan
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--gemms", default="up,down,grad_act,grad_input,wgrad_up,wgrad_down",
                        help="comma-separated; NAME_cublas times torch._grouped_mm on NAME's operands (up, down, "
                             "grad_act, grad_input, wgrad_up, wgrad_down)")
    parser.add_argument("--tma", default="off", choices=("off", "on", "both"),
                        help="the row GEMMs' tiles by pointer loads (off), tensor descriptors (on), or each")
    parser.add_argument("--top", type=int, default=0,
                        help="only the first N tile candidates (the list starts with the ones that won before)")
    parser.add_argument("--loops", action="store_true",
                        help="each tile candidate also with a persistent grid (one program per SM), alone and with "
                             "Triton's flatten and warp_specialize loop options")
    parser.add_argument("--tiles", default="",
                        help="tile candidates instead of the list: 'BM,BN,BK,WARPS,STAGES;...'")
    parser.add_argument("--balanced", action="store_true",
                        help="also on a routing that gives every expert exactly T*K/E rows (the same GEMMs with no "
                             "partial row tiles and no unevenness), beside the benchmark's routing")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sweep_megakernel.json"))
    args = parser.parse_args()
    import dataclasses

    tiles = CANDIDATES[:args.top] if args.top else CANDIDATES
    if args.tiles:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    loops = [{}] + ([dict(num_programs=sms, flatten=f, warp_specialize=w) for f in (False, True) for w in (False, True)]
                    if args.loops else [])
    candidates = [(t, extra) for t in tiles for extra in loops]
    variants = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
    dtype, dev = torch.bfloat16, "cuda"
    silu = encode("chunk", SILU_GLU_EXPR)
    results = []
    routings = ("benchmark", "balanced") if args.balanced else ("benchmark",)
    for name, routing in [(n, r) for n in args.shapes.split(",") for r in routings]:
        H, I, E, K = SHAPES[name]
        T = args.tokens
        x, ids, w, dy = make_inputs(H, I, E, K, T, dtype, dev)
        if routing == "balanced":  # token t takes experts (t*K + j) mod E: T*K/E rows each when E divides T*K
            ids = ((torch.arange(T, device=dev)[:, None] * K + torch.arange(K, device=dev)) % E).to(ids.dtype)
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        for bm in sorted({t[0] for t in tiles} | {128}):
            tiles_m = int(((counts + bm - 1) // bm).sum())
            print(json.dumps({"shape": name, "routing": routing, "rows": T * K, "min_rows": int(counts.min()),
                              "max_rows": int(counts.max()), "block_m": bm, "row_tiles": tiles_m,
                              "tile_rows_used": round(T * K / (tiles_m * bm), 4)}), flush=True)
        w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
        w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
        spec = ExpertsSpec("oi", "oi", silu, dtype)
        layer = megakernel.Layer(x, ids, w_up, w_down, spec)
        row_order, slot_row, offsets = routing_plan(ids, E, clamp=False)
        S = T * K
        up = torch.randn(S, 2 * I, device=dev, dtype=dtype)
        act = torch.randn(S, I, device=dev, dtype=dtype)
        down = torch.empty(S, H, device=dev, dtype=dtype)
        d_up = torch.empty_like(up)
        d_w_up, d_w_down = torch.empty_like(w_up), torch.empty_like(w_down)
        weights = w.reshape(-1).contiguous()
        x_rows = x[row_order // K]
        dy_rows = (dy[row_order // K] * weights[row_order, None]).to(dtype)
        common = dict(row_order=row_order, offsets=offsets)
        launches = {
            "up": (2 * S * H * 2 * I, lambda c: megakernel.rows_gemm(
                layer, c, a=x_rows, gather=False, b=layer.up_eff, n=I, k=H, epilogue=1, c=up, d=act, two_halves=True,
                col_mult=1, up_shift=I, **common)),
            "down": (2 * S * I * H, lambda c: megakernel.rows_gemm(
                layer, c, a=act, gather=False, b=layer.down_eff, n=H, k=I, epilogue=0, c=down, **common)),
            "grad_act": (2 * S * H * I, lambda c: megakernel.rows_gemm(
                layer, c, a=dy_rows, gather=False, b=layer.down_eff.transpose(1, 2), n=I, k=H, epilogue=0, c=act,
                **common)),
            "grad_input": (2 * S * 2 * I * H, lambda c: megakernel.rows_gemm(
                layer, c, a=d_up, gather=False, b=layer.up_eff.transpose(1, 2), n=H, k=2 * I, epilogue=0, c=down,
                **common)),
            "wgrad_up": (2 * S * H * 2 * I, lambda c: megakernel.weight_grad(
                layer, c, p=x, p_gather=True, q=d_up, q_gather=False, q_scale=False, w=None, grad=d_w_up, m_dim=2,
                n_dim=1, **common)),
            "wgrad_down": (2 * S * I * H, lambda c: megakernel.weight_grad(
                layer, c, p=act, p_gather=False, q=dy, q_gather=True, q_scale=True, w=weights, grad=d_w_down,
                m_dim=2, n_dim=1, **common)),
            # The weight gradients on operands gathered (and scaled) beforehand: plain strided GEMMs.
            "wgrad_up_mat": (2 * S * H * 2 * I, lambda c: megakernel.weight_grad(
                layer, c, p=x_rows, p_gather=False, q=d_up, q_gather=False, q_scale=False, w=None, grad=d_w_up,
                m_dim=2, n_dim=1, **common)),
            "wgrad_down_mat": (2 * S * I * H, lambda c: megakernel.weight_grad(
                layer, c, p=act, p_gather=False, q=dy_rows, q_gather=False, q_scale=False, w=None, grad=d_w_down,
                m_dim=2, n_dim=1, **common)),
        }
        for gemm in args.gemms.split(","):
            if gemm.endswith("_cublas"):  # torch._grouped_mm (CUTLASS) on the same operands, for comparison
                base = gemm[:-7]
                offs = offsets.to(torch.int32)
                if base.startswith("wgrad"):
                    flops = launches[base + "_mat"][0]
                    a, b = (x_rows, d_up) if base == "wgrad_up" else (act, dy_rows)
                    run = (lambda a=a, b=b: torch._grouped_mm(b.t(), a, offs=offs))
                else:  # the row GEMMs: rows [S, K] times each expert's [K, N] weight (plain output, no epilogue)
                    flops = launches[base][0]
                    a, b = {"up": (x_rows, w_up.transpose(1, 2)), "down": (act, w_down.transpose(1, 2)),
                            "grad_act": (dy_rows, w_down), "grad_input": (d_up, w_up)}[base]
                    run = (lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs))
                ms = time_cuda(run, iters=10, warmup=2)
                row = {"shape": name, "routing": routing, "gemm": gemm, "ms": round(ms, 4),
                       "tflops": round(flops / ms / 1e9, 1)}
                print(json.dumps(row), flush=True)
                results.append(row)
                continue
            flops, launch = launches[gemm]
            for tma in variants:
                layer.config = dataclasses.replace(layer.config, tma=tma)
                rows = []
                for (bm, bn, bk, warps, stages), extra in candidates:
                    cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, **extra)
                    label = [bm, bn, bk, warps, stages] + ([extra["num_programs"], int(extra["flatten"]),
                                                            int(extra["warp_specialize"])] if extra else [])
                    try:
                        ms = time_cuda(lambda: launch(cfg), iters=10, warmup=2)
                        rows.append({"config": label, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)})
                    except Exception as exc:  # noqa: BLE001
                        rows.append({"config": label, "error": repr(exc)[:120]})
                ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
                best = ok[0] if ok else None
                print(json.dumps({"shape": name, "routing": routing, "gemm": gemm, "tma": tma, "best": best,
                                  "all": [(r["config"], r.get("tflops", r.get("error"))) for r in rows]}), flush=True)
                results.append({"shape": name, "routing": routing, "gemm": gemm, "tma": tma, "rows": rows})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
