"""The combine kernel (kernels/triton_routing.py) at several tokens a program: µs a call and the same bits as one token
a program, for the K of the EP exchange's received rows (1), Mixtral (2) and Qwen3-30B-A3B (8).

    python benchmarks/probes/combine_probe.py [--out combine_probe.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# (name, tokens, hidden, K): the rows a rank of the 2-rank EP layer receives at Qwen3-30B-A3B's shape, Mixtral-8x7B's
# and Qwen3-30B-A3B's layer at T = 8192
CASES = [("ep-received", 65536, 2048, 1), ("mixtral", 8192, 4096, 2), ("qwen3-30b-a3b", 8192, 2048, 8)]


def main():
    from uniep_dynamo.kernels import triton_routing
    from uniep_dynamo.tuner import time_cuda

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "combine_probe.json"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    default = triton_routing.combine_block_t
    for name, tokens, hidden, top_k in CASES:
        slots = tokens * top_k
        rows = torch.randn(slots, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        slot_row = torch.randperm(slots, device=dev, generator=g)
        offsets = torch.tensor([slots], device=dev)
        weights = torch.rand(tokens, top_k, device=dev, generator=g)
        base = None
        for block_t in (1, 2, 4, 8, 16, 32):
            triton_routing.combine_block_t = lambda k, b=block_t: b
            call = lambda: triton_routing.combine(rows, slot_row, weights, offsets, tokens, top_k, torch.bfloat16)
            out = call()
            base = out if base is None else base
            us = time_cuda(call, 50, 10) * 1e3
            row = {"case": name, "tokens_per_program": block_t, "us": round(us, 1), "default": default(top_k) == block_t,
                   "same_bits": bool(torch.equal(out, base))}
            rows_out.append(row)
            print(row, flush=True)
    triton_routing.combine_block_t = default
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
