"""What the op graphs (kernels/op_graphs.py) hold on the GPU: a model's layers of one size (expert weights of their own
each) call uniep.moe_block under no_grad until each has its CUDA graph, at each token count given, one after the
other; then the graphs are dropped. Per step: the CUDA caching allocator's reserved and allocated MB (after
``empty_cache``, so reserved is what is in use or held by a graph's pool), op_graphs' own estimate (``_BYTES``), the
graphs and pools. Qwen3-30B-A3B's shape, bf16.

    python benchmarks/probes/op_graph_memory_probe.py --layers 8 --tokens 8,1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys

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
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", default="8,1024")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "op_graph_memory_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    H, I, E, K = bench.SHAPES[args.shape]
    layers = [(torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02,
               torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02,
               torch.randn(E, H, device=dev, dtype=dtype) * 0.02) for _ in range(args.layers)]
    marked = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype, inference=True).encode()
    op_graphs.clear()
    rows = []

    def row(step):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        r = {"step": step, "reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1),
             "allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1),
             "estimate_mb": round(op_graphs._BYTES[0] / 2**20, 1), "graphs": len(op_graphs._GRAPHS),
             "pools": len(op_graphs._POOLS), "captured": op_graphs.counts["captured"]}
        rows.append(r)
        print(json.dumps(r), flush=True)

    row("weights only")
    with torch.no_grad():
        for tokens in (int(t) for t in args.tokens.split(",")):
            planned = tokens * K > op_graphs.MAX_SLOTS  # as backend._fuse_block leaves the router's plan
            router = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=dtype, plan=planned).encode()
            x = torch.randn(tokens, H, device=dev, dtype=dtype)
            for n, (w_up, w_down, router_w) in enumerate(layers):
                for _ in range(3):  # run, capture, replay
                    out = torch.ops.uniep.moe_block(x, router_w, None, None, router, x, w_up, w_down, None, None,
                                                    marked)
                del out
                if n in (0, len(layers) - 1):
                    row(f"{tokens} tokens, {n + 1} layer(s) graphed")
    op_graphs.clear()
    row("after op_graphs.clear()")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
