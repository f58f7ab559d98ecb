"""Host time of one uniep.ep_layer call at world size 1 (a one-rank NCCL group in this process), forward and
backward, beside the single-GPU op uniep.moe_experts on the same inputs (issue 37: "one GPU: the op at world size 1
against the single-GPU op, bitwise; its host time per call"). Median µs a call over --calls calls, the GPU
synchronized before each timed call (outside the timed region), so each call's host time is its own; ep_layer's
forward includes its one host synchronization (the split sizes), so it waits for its own plan kernels and the
count all-gather. Also the synchronizing calls of one call each way (torch.cuda.set_sync_debug_mode("warn")'s
warnings; tests/test_ep_single_rank.py asserts at most one). Providers:

  moe_experts         the single-GPU op
  ep_layer            overlap off (the all-to-alls around the experts op: HF's default, overlap_ep=False)
  ep_layer_overlap    the overlapped exchange (symmetric memory)

    python benchmarks/probes/ep_host_probe.py [--shape qwen3-30b-a3b] [--tokens 8192] [--calls 50]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def host_times(fn, leaves, grad, calls: int, warmup: int = 5):
    """(median forward µs, median backward µs) of out = fn(*leaves); out.backward(grad), host time only."""
    forward, backward = [], []
    for i in range(warmup + calls):
        inputs = [t.detach().requires_grad_() for t in leaves]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*inputs)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.backward(grad)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t3 - t2)
    return [round(sorted(t)[len(t) // 2] * 1e6, 1) for t in (forward, backward)]


def sync_calls(fn, leaves, grad):
    """[forward, backward]: the synchronizing calls torch's sync debug mode flags in one call each way."""
    inputs = [t.detach().requires_grad_() for t in leaves]
    box = {}
    counts = []
    for step in (lambda: box.setdefault("out", fn(*inputs)), lambda: box["out"].backward(grad)):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    return counts


def main():
    import bench_moe_layer as bench

    import uniep_dynamo  # noqa: F401  (registers the ops)
    from uniep_dynamo.ep import MULTICAST_OFF
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_host_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    torch.cuda.set_device(dev)
    H, I, E, K = bench.SHAPES[args.shape]
    x, ids, w, grad = bench.make_inputs(H, I, E, K, args.tokens, dtype, "cuda")
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype).encode()

    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    store_dir = tempfile.mkdtemp()
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1,
                            device_id=dev)
    group_name = dist.group.WORLD.group_name
    providers = {
        "moe_experts": lambda h, tw, a, b: torch.ops.uniep.moe_experts(h, ids, tw, a, b, None, None, [], spec)[0],
        "ep_layer": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec, group_name, 1,
                                                                 False, "")[0],
        "ep_layer_overlap": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec,
                                                                         group_name, 1, True, "")[0],
    }
    results = {}
    try:
        for name, fn in providers.items():
            leaves = (x, w, w_up, w_down)
            forward_us, backward_us = host_times(fn, leaves, grad, args.calls)
            forward_syncs, backward_syncs = sync_calls(fn, leaves, grad)
            results[name] = {"forward_us": forward_us, "backward_us": backward_us, "forward_syncs": forward_syncs,
                             "backward_syncs": backward_syncs}
            print(f"{name:18s} forward {forward_us:9.1f} µs ({forward_syncs} sync)   "
                  f"backward {backward_us:9.1f} µs ({backward_syncs} sync)", flush=True)
    finally:
        dist.destroy_process_group()
    report = {"shape": args.shape, "tokens": args.tokens, "calls": args.calls, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "host": results}
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
