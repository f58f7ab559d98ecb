"""Peak memory of one uniep.ep_layer call, forward + backward, at world size 1 (a one-rank NCCL group in this
process), beside the single-GPU op uniep.moe_experts on the same inputs: what the EP layer holds above the op it
wraps, measurable on one GPU (bench_ep.py measures it at 2 and more ranks). The spec has reuse_saved (the compile's
reuse_saved_buffers, its default), so both sides run the experts' in-place backward.

    python benchmarks/probes/ep_peak_probe.py [--shape qwen3-30b-a3b] [--tokens 8192]

Prints, per provider, the peak allocated memory above what was allocated before the call (MiB), and writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def peak_mib(fn, leaves, grad) -> float:
    """Peak MiB above the memory allocated before one fn(*leaves) forward and backward (after a warm-up call)."""
    for measured in (False, True):
        inputs = [t.detach().clone().requires_grad_() for t in leaves]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*inputs).backward(grad)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        del inputs
    return round(peak, 1)


def main():
    import bench_moe_layer as bench

    import uniep_dynamo  # noqa: F401  (registers the ops)
    from uniep_dynamo.ep import MULTICAST_OFF
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_peak_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    torch.cuda.set_device(dev)
    H, I, E, K = bench.SHAPES[args.shape]
    x, ids, w, grad = bench.make_inputs(H, I, E, K, args.tokens, dtype, "cuda")
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    spec = dataclasses.replace(ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype),
                               reuse_saved=True).encode()
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    group_name = dist.group.WORLD.group_name
    providers = {
        "moe_experts": lambda h, tw, a, b: torch.ops.uniep.moe_experts(h, ids, tw, a, b, None, None, [], spec)[0],
        "ep_layer": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec, group_name, 1,
                                                                 False, "")[0],
    }
    results = {}
    try:
        for name, fn in providers.items():
            results[name] = peak_mib(fn, (x, w, w_up, w_down), grad)
            print(f"{name:12s} peak {results[name]:9.1f} MiB above the inputs", flush=True)
    finally:
        dist.destroy_process_group()
    report = {"shape": args.shape, "tokens": args.tokens, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "peak_mib": results}
    print(json.dumps(report))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
