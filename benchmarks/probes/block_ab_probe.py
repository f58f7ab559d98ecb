"""Host time of uniep.moe_block against the two ops it replaces (the router op, then the marked experts op taking the
router's plan where the block's router builds one), in interleaved rounds of one process, at the token counts given:
median µs a call, the GPU synchronized between calls (outside the timed region). Qwen3-30B-A3B's shape, bf16.

    python benchmarks/probes/block_ab_probe.py --tokens 8,1024 --rounds 5 --calls 100
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
import bench_moe_layer as bench  # noqa: E402


def main():
    import uniep_dynamo  # noqa: F401  (registers the ops)
    from uniep_dynamo.kernels import op_graphs
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec, RouterSpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="8,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "block_ab_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    H, I, E, K = bench.SHAPES[args.shape]
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    router_w = torch.randn(E, H, device=dev, dtype=dtype) * 0.02
    marked = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype, inference=True).encode()
    rows = {}
    with torch.no_grad():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, device=dev, dtype=dtype)
            planned = tokens * K > op_graphs.MAX_SLOTS  # as backend._fuse_block leaves the router's plan
            router = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=dtype, plan=planned).encode()

            def two_ops():
                _, weights, ids, *plan = torch.ops.uniep.moe_router(x, router_w, None, None, router)
                given = dict(zip(("plan_row_order", "plan_slot_row", "plan_offsets"), plan)) if planned else {}
                return torch.ops.uniep.moe_experts(x, ids, weights, w_up, w_down, None, None, [], marked, **given)[0]

            def block():
                return torch.ops.uniep.moe_block(x, router_w, None, None, router, x, w_up, w_down, None, None, marked)

            assert torch.equal(two_ops(), block())
            times = {"two_ops": [], "block": []}
            for _ in range(args.rounds):
                for name, fn in (("two_ops", two_ops), ("block", block)):
                    walls = []
                    for _ in range(args.calls):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn()
                        walls.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                    times[name].append(statistics.median(walls) * 1e6)
            rows[tokens] = {name: {"median_us": round(statistics.median(t), 1), "rounds_us": [round(v, 1) for v in t]}
                            for name, t in times.items()}
            print(tokens, json.dumps(rows[tokens]))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
