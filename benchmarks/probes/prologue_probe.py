"""Where a synchronized step of the compiled experts layer waits before and between its kernels (issue 39: uniep's
synchronized step is 0.6 ms longer than its back-to-back one on Qwen3-30B-A3B, inductor's sort path 0.3 ms, and
mode="reduce-overhead" did not shorten it). One GPU; the layer of bench_moe_layer.py compiled by uniep; each step
starts on an idle GPU, as bench_moe_layer's synchronized timing does.

CUDA events recorded by the host at marks inside the step. While the GPU is idle an event completes as soon as it is
recorded, so its time from the step's start event is when the host got there; while the GPU is busy, when the GPU
reached it. Marks: the op's forward entered (megakernel.experts_forward), its routing plan issued, the forward
returned, the backward entered (megakernel.experts_backward) and returned, the step's end. Medians of --iters steps,
ms from the start event; plus the same step's total with the marks off, and back to back.

    python benchmarks/probes/prologue_probe.py [--shape qwen3-30b-a3b] [--iters 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MARKS = []  # (name, event) of the current step


def mark(name):
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    MARKS.append((name, event))


def wrap(module, attr, before, after):
    inner = getattr(module, attr)

    def wrapped(*args, **kwargs):
        mark(before)
        try:
            return inner(*args, **kwargs)
        finally:
            mark(after)
    setattr(module, attr, wrapped)


def main():
    import bench_moe_layer as bench

    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel, triton_routing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prologue_probe.json"))
    args = parser.parse_args()
    H, I, E, K = bench.SHAPES[args.shape]
    experts = bench.hf_experts(H, I, E, K, torch.bfloat16, "cuda")
    x, ids, w, grad = bench.make_inputs(H, I, E, K, args.tokens, torch.bfloat16, "cuda")
    compiled = torch.compile(experts, backend="uniep")
    run = bench.step(lambda a, b, c: compiled(a, b, c), experts, x, ids, w, grad)
    plain_sync = bench.time_cuda(run, args.iters, 3)
    b2b = bench.time_cuda_back_to_back(run, args.iters)
    wrap(megakernel, "experts_forward", "forward entered", "forward returned")
    wrap(megakernel, "experts_backward", "backward entered", "backward returned")
    wrap(triton_routing, "routing_plan", "plan called", "plan issued")
    steps = []
    for i in range(args.iters + 3):
        torch.cuda.synchronize()
        MARKS.clear()
        mark("start")
        run()
        mark("end")
        torch.cuda.synchronize()
        if i >= 3:
            start = MARKS[0][1]
            steps.append({name: start.elapsed_time(event) for name, event in MARKS[1:]})
    names = list(steps[0])
    medians = {name: round(statistics.median(s[name] for s in steps), 3) for name in names}
    report = {"shape": args.shape, "tokens": args.tokens, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "synchronized_ms": round(plain_sync, 3), "back_to_back_ms": round(b2b, 3),
              "marks_ms_from_start": medians}
    for name, value in medians.items():
        print(f"{name:20s} {value:8.3f} ms")
    print(json.dumps(report))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
