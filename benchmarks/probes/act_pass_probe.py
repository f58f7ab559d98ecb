"""The backward's element-wise passes between the activation-gradient GEMM and the weight gradients, timed alone on
one GPU (bf16, an HF shape at T tokens): what config.late_routing_weight replaces and what it runs instead.

    knob off   the weighted gather of the output-gradient rows (w * dY[tok], rounded), the routing-weight gradient
               <dY[t], down[t, k]> over H (_routing_weight_grad), the activation backward (_act_backward)
    knob on    the unweighted gather (where no GEMM gathers the rows itself), and _act_backward_late_weight with
               _sum_weight_grad_parts, at each --tiles "rows x columns x warps" tile

    python benchmarks/probes/act_pass_probe.py --shapes qwen3-30b-a3b,olmoe --tiles 16x256x4,8x256x4,32x128x4

Prints a table and writes $OUT/act_pass_probe.json. The column tile changes how the weight gradient's row sum is
split, so each tile's bits are its own; the probe says whether d_up and w * act match the first tile's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import SHAPES, make_inputs  # noqa: E402

from uniep_dynamo.kernels import megakernel, triton_routing  # noqa: E402
from uniep_dynamo.kernels.reference import routing_plan  # noqa: E402
from uniep_dynamo.spec import ExpertsSpec  # noqa: E402
from uniep_dynamo.tuner import time_cuda  # noqa: E402

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--tiles", default="16x256x4,8x256x4,32x128x4,16x128x4,16x512x8")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "act_pass_probe.json"))
    args = parser.parse_args()
    from uniep_dynamo.kernels import gate_program

    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    print(f"# {data['device']}, torch {torch.__version__}")
    for name in args.shapes.split(","):
        H, I, E, K = SHAPES[name]
        T = args.tokens
        x, ids, w, _ = make_inputs(H, I, E, K, T, torch.bfloat16, "cuda")
        g = torch.Generator(device="cuda").manual_seed(3)
        w_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
        w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
        spec = ExpertsSpec("oi", "oi", gate_program.encode("chunk", gate_program.SILU_GLU_EXPR), torch.bfloat16)
        layer = megakernel.Layer(x, ids, w_up, w_down, spec)
        row_order, slot_row, offsets = routing_plan(ids, E)
        R = row_order.numel()
        up = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g)
        raw = torch.randn(R, I, device="cuda", dtype=torch.bfloat16, generator=g)
        down = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, generator=g)
        d_out = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        weights = w.reshape(-1).contiguous()
        halves = dict(two_halves=True, col_mult=1, up_shift=I)
        d_up, scratch = torch.empty_like(up), torch.empty_like(down)

        def off():
            triton_routing.routing_weight_grad(d_out, down, slot_row, offsets, T, K, w.dtype)
            triton_routing.gather_rows(d_out, row_order, K, weights, out=scratch, offsets=offsets)
            megakernel.act_backward(layer, d_act=raw.clone(), up=up, d_up=d_up, offsets=offsets, **halves)

        row = {"shape": name, "T": T}
        clone_ms = time_cuda(lambda: raw.clone(), args.iters, 5)
        row["knob_off_ms"] = round(time_cuda(off, args.iters, 5) - clone_ms, 4)
        row["weighted_gather_ms"] = round(time_cuda(lambda: triton_routing.gather_rows(
            d_out, row_order, K, weights, out=scratch, offsets=offsets), args.iters, 5), 4)
        row["routing_weight_grad_ms"] = round(time_cuda(lambda: triton_routing.routing_weight_grad(
            d_out, down, slot_row, offsets, T, K, w.dtype), args.iters, 5), 4)
        row["act_backward_ms"] = round(time_cuda(lambda: megakernel.act_backward(
            layer, d_act=raw.clone(), up=up, d_up=d_up, offsets=offsets, **halves), args.iters, 5) - clone_ms, 4)
        first = None
        for tile in args.tiles.split(","):
            megakernel.LATE_ACT_TILE = tuple(int(v) for v in tile.split("x"))
            d_w = torch.empty(T, K, dtype=w.dtype, device="cuda")
            buf = raw.clone()

            def late():
                buf.copy_(raw)
                megakernel.act_backward_late_weight(layer, d_raw=buf, up=up, d_up=d_up, row_order=row_order,
                                                    weights=weights, d_weights=d_w, offsets=offsets, **halves)

            copy_ms = time_cuda(lambda: buf.copy_(raw), args.iters, 5)
            row[f"late_{tile}_ms"] = round(time_cuda(late, args.iters, 5) - copy_ms, 4)
            late()
            got = (d_up.clone(), buf.clone())
            if first is None:
                first = got
            row[f"late_{tile}_same_elementwise_bits"] = all(torch.equal(a, b) for a, b in zip(got, first))
        print(json.dumps(row), flush=True)
        data["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
