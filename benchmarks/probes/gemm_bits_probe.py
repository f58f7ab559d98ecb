"""Do the MegaKernel's Triton GEMMs and torch._grouped_mm (CUTLASS on Hopper) give the same bits?

For each shape and each of the six grouped GEMMs of an MoE layer, run the heuristic Triton config and
``torch._grouped_mm`` on the same operands and report whether the outputs are bitwise equal (else how many
elements differ and by how much), with both times. Then two properties the EP path would need from
``torch._grouped_mm`` if it served the MegaKernel:

- the rows of one expert computed alone (CUTLASS's "small" tile path: few rows per group) against the
  same rows inside the full call (the large-tile path);
- a weight gradient of an expert with no rows is exact zeros.

    python benchmarks/probes/gemm_bits_probe.py --shapes qwen3-30b-a3b,mixtral

``--device cpu`` (with TRITON_INTERPRET=1, fp32, a tiny shape) only checks that the probe runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_moe_layer import SHAPES, make_inputs, time_cuda  # noqa: E402
from uniep_dynamo.tuner import time_host  # noqa: E402


def compare(a, b) -> dict:
    same = torch.equal(a, b)
    out = {"bitwise": same}
    if not same:
        diff = (a.float() - b.float()).abs()
        out.update(differing=int((a != b).sum()), of=a.numel(), max_abs=float(diff.max()),
                   max_ref=float(b.float().abs().max()))
    return out


def main():
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_gemm import GLU_FWD, STORE
    from uniep_dynamo.kernels.triton_routing import routing_plan
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32 under TRITON_INTERPRET=1: "
                        "a smoke test of the probe, e.g. --shapes tiny --tokens 64)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm_bits_probe.json"))
    args = parser.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    timer = time_cuda if dev == "cuda" else time_host
    shapes = dict(SHAPES, tiny=(32, 16, 4, 2))
    results = []
    for name in args.shapes.split(","):
        H, I, E, K = shapes[name]
        T = args.tokens
        x, ids, w, dy = make_inputs(H, I, E, K, T, dtype, dev)
        g = torch.Generator(device=dev).manual_seed(1)
        w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype, generator=g) * 0.02
        w_down = torch.randn(E, H, I, device=dev, dtype=dtype, generator=g) * 0.02
        spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype)
        layer = megakernel.Layer(x, ids, w_up, w_down, spec)
        cfg = layer.config
        row_order, slot_row, offsets = routing_plan(ids, E, clamp=False)
        offs = offsets.to(torch.int32)
        S = T * K
        weights = w.reshape(-1).contiguous()
        x_rows = x[row_order // K]
        dy_rows = (dy[row_order // K].float() * weights[row_order, None].float()).to(dtype)
        act = torch.randn(S, I, device=dev, dtype=dtype, generator=g)
        d_up = torch.randn(S, 2 * I, device=dev, dtype=dtype, generator=g) * 0.1
        common = dict(row_order=row_order, offsets=offsets)

        def rows(gemm_cfg, a, b, n, k, epilogue=STORE, halves=False):
            c = torch.empty(S, b.shape[2] if epilogue == GLU_FWD else n, device=dev, dtype=dtype)
            d = torch.empty(S, n, device=dev, dtype=dtype) if epilogue == GLU_FWD else None
            megakernel.rows_gemm(layer, gemm_cfg, a=a, gather=False, b=b, n=n, k=k, epilogue=epilogue, c=c, d=d,
                                 two_halves=halves, col_mult=1, up_shift=I if halves else 0, **common)
            return c

        def wgrad(gemm_cfg, p, q, shape):
            grad = torch.empty(shape, device=dev, dtype=dtype)  # [E, out, in] ("oi"): dims (2, 1)
            megakernel.weight_grad(layer, gemm_cfg, p=p, p_gather=False, q=q, q_gather=False, q_scale=False, w=None,
                                   grad=grad, m_dim=2, n_dim=1, **common)
            return grad

        cases = {
            # name: (Triton launch, torch._grouped_mm launch, FLOPs)
            "up": (lambda: rows(cfg.up, x_rows, layer.up_eff, I, H, GLU_FWD, True),
                   lambda: torch._grouped_mm(x_rows, layer.up_eff, offs=offs), 2 * S * H * 2 * I),
            "down": (lambda: rows(cfg.down, act, layer.down_eff, H, I),
                     lambda: torch._grouped_mm(act, layer.down_eff, offs=offs), 2 * S * I * H),
            "grad_act": (lambda: rows(cfg.grad_act, dy_rows, layer.down_eff.transpose(1, 2), I, H),
                         lambda: torch._grouped_mm(dy_rows, layer.down_eff.transpose(1, 2), offs=offs),
                         2 * S * H * I),
            "grad_input": (lambda: rows(cfg.grad_input, d_up, layer.up_eff.transpose(1, 2), H, 2 * I),
                           lambda: torch._grouped_mm(d_up, layer.up_eff.transpose(1, 2), offs=offs), 2 * S * 2 * I * H),
            # grad[e][o, i] = sum over e's rows of Q[r, o] * P[r, i]: [E, out, in] straight from CUTLASS
            "wgrad_up": (lambda: wgrad(cfg.wgrad_up, x_rows, d_up, w_up.shape),
                         lambda: torch._grouped_mm(d_up.t(), x_rows, offs=offs), 2 * S * H * 2 * I),
            "wgrad_down": (lambda: wgrad(cfg.wgrad_down, act, dy_rows, w_down.shape),
                           lambda: torch._grouped_mm(dy_rows.t(), act, offs=offs), 2 * S * I * H),
        }
        for gemm, (triton_run, cutlass_run, flops) in cases.items():
            ref = triton_run()
            got = cutlass_run()
            row = {"shape": name, "gemm": gemm, **compare(got, ref)}
            row["triton_ms"] = round(timer(triton_run, iters=10, warmup=2), 4)
            row["grouped_mm_ms"] = round(timer(cutlass_run, iters=10, warmup=2), 4)
            row["triton_tflops"] = round(flops / row["triton_ms"] / 1e9, 1)
            row["grouped_mm_tflops"] = round(flops / row["grouped_mm_ms"] / 1e9, 1)
            print(json.dumps(row), flush=True)
            results.append(row)
        # The first expert's rows alone: every other group empty, so few rows per group (CUTLASS's "small"
        # 64x128x128 pingpong tiles) against the full call's 128x256x64 cooperative tiles.
        n0 = int(offsets[0])
        alone = torch.full_like(offs, n0)
        full = torch._grouped_mm(act, layer.down_eff, offs=offs)[:n0]
        part = torch._grouped_mm(act[:n0].contiguous(), layer.down_eff, offs=alone)
        row = {"shape": name, "check": "one expert alone vs in the full call (down)", "rows": n0, **compare(part, full)}
        print(json.dumps(row), flush=True)
        results.append(row)
        # Experts 0 and 1 swapped in size: expert 0 gets no rows, so its weight gradient must be zeros.
        empty_first = offs.clone()
        empty_first[0] = 0
        grad = torch._grouped_mm(dy_rows.t(), act, offs=empty_first)
        row = {"shape": name, "check": "weight gradient of an expert with no rows is zeros",
               "zeros": bool((grad[0] == 0).all()), "nonzero_elsewhere": bool((grad[1] != 0).any())}
        print(json.dumps(row), flush=True)
        results.append(row)
        # Run to run.
        again = torch._grouped_mm(d_up.t(), x_rows, offs=offs)
        row = {"shape": name, "check": "grouped_mm run to run (wgrad_up)",
               **compare(again, torch._grouped_mm(d_up.t(), x_rows, offs=offs))}
        print(json.dumps(row), flush=True)
        results.append(row)
        del x, dy, w_up, w_down, x_rows, dy_rows, act, d_up
        if dev == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
