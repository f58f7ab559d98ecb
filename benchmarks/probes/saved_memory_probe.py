"""What one experts layer keeps for its backward: GPU memory held between the forward and the backward (the tensors
autograd saved, beyond the output), the HF experts module compiled by uniep with the late_routing_weight knob off and
on (UNIEP_LATE_ROUTING_WEIGHT, read when the forward runs), and by inductor. bf16, one GPU.

    python benchmarks/probes/saved_memory_probe.py --shapes qwen3-30b-a3b,olmoe

Prints MB held after the forward and the step's peak above the inputs, and writes $OUT/saved_memory_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import SHAPES, hf_experts, make_inputs  # noqa: E402


def held(fn, experts, x, ids, w, grad_out):
    """(MB held after the forward, output excluded; MB peak of forward + backward), both above the inputs."""
    for _ in range(2):  # compile, and the allocator's steady state
        out = fn(x.detach().requires_grad_(), ids, w.detach().requires_grad_())
        out.backward(grad_out)
        del out
        for p in experts.parameters():
            p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(x.detach().requires_grad_(), ids, w.detach().requires_grad_())
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for p in experts.parameters():
        p.grad = None
    return round(after / 2**20, 1), round(peak / 2**20, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "saved_memory_probe.json"))
    args = parser.parse_args()
    import uniep_dynamo  # noqa: F401

    rows = []
    print(f"# {torch.cuda.get_device_name()}: MB held after the forward (output excluded) / MB peak of the step")
    for name in args.shapes.split(","):
        H, I, E, K = SHAPES[name]
        experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
        x, ids, w, grad_out = make_inputs(H, I, E, K, args.tokens, torch.bfloat16, "cuda")
        row = {"shape": name, "T": args.tokens}
        for label, backend, late in (("inductor", "inductor", None), ("uniep", "uniep", "0"),
                                     ("uniep_late_routing_weight", "uniep", "1")):
            torch._dynamo.reset()
            if late is not None:
                os.environ["UNIEP_LATE_ROUTING_WEIGHT"] = late
            compiled = torch.compile(experts, backend=backend)
            row[f"{label}_held_mb"], row[f"{label}_peak_mb"] = held(compiled, experts, x, ids, w, grad_out)
        os.environ.pop("UNIEP_LATE_ROUTING_WEIGHT", None)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
