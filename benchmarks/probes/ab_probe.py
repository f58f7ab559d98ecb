"""Two or more bench_moe_layer.py providers timed in alternation, round by round, in one process (one GPU): the
synchronized median and the back-to-back mean of each round, then each provider's median over the rounds and its
ratio to the first provider's. bench_moe_layer.py times its providers one after the other, so a drift of the GPU's or
the host's speed between them (its synchronized times moved by 8% between calls of one session) lands in their ratio;
here each round times every provider within seconds of the others.

    python benchmarks/probes/ab_probe.py --shapes qwen3-30b-a3b,olmoe --providers uniep,uniep_gated --rounds 7

``--quack GEMM=CONFIG[;GEMM=CONFIG...]`` adds a provider ``uniep[GEMM=CONFIG...]``: uniep with those QuACK configs in
place of config.QUACK_CONFIGS' (a scheduling knob: the same bits) around its forward and backward, e.g. ``--quack
up=128x256/coop/1x1``.

Prints a table and writes $OUT/ab_probe.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import (SHAPES, hf_experts, make_inputs, providers, step, time_cuda,  # noqa: E402
                             time_cuda_back_to_back)


def quack_variant(base, configs: dict):
    """``base`` (a providers() function) run with config.QUACK_CONFIGS' entries ``configs`` around its forward and
    backward (the heuristics' cache cleared on the way in and out)."""
    from uniep_dynamo.kernels import config as kconfig

    @contextlib.contextmanager
    def around():
        before = dict(kconfig.QUACK_CONFIGS)
        kconfig.QUACK_CONFIGS.update(configs)
        kconfig.heuristic_config.cache_clear()
        try:
            yield
        finally:
            kconfig.QUACK_CONFIGS.clear()
            kconfig.QUACK_CONFIGS.update(before)
            kconfig.heuristic_config.cache_clear()

    def run(x, ids, w):
        return base(x, ids, w)
    run.around = around
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--providers", default="uniep,uniep_gated")
    parser.add_argument("--quack", default="", help="GEMM=CONFIG[;GEMM=CONFIG...]: a provider with those QuACK configs")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ab_probe.json"))
    args = parser.parse_args()
    names = args.providers.split(",")
    variant = dict(item.split("=", 1) for item in args.quack.split(";") if item)
    if variant:
        names.append("uniep[" + ";".join(f"{g}={c}" for g, c in variant.items()) + "]")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "rounds": args.rounds, "iters": args.iters, "shapes": {}}
    for shape in args.shapes.split(","):
        H, I, E, K = SHAPES[shape]
        experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
        x, ids, w, grad_out = make_inputs(H, I, E, K, args.tokens, torch.bfloat16, "cuda")
        every = providers(experts)
        if variant:
            every[names[-1]] = quack_variant(every["uniep"], variant)
        runs = {n: step(every[n], experts, x, ids, w, grad_out) for n in names}
        for run in runs.values():  # compiles, QuACK's kernels, the tuning caches
            for _ in range(3):
                run()
        torch.cuda.synchronize()
        times = {n: {"synchronized": [], "back_to_back": []} for n in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]  # neither provider always first
            for n in order:
                times[n]["synchronized"].append(round(time_cuda(runs[n], args.iters, 2), 4))
                times[n]["back_to_back"].append(round(time_cuda_back_to_back(runs[n], args.iters), 4))
        summary = {n: {k: round(statistics.median(v), 4) for k, v in t.items()} for n, t in times.items()}
        first = summary[names[0]]
        print(f"# {result['device']} {shape} T={args.tokens}: median over {args.rounds} alternating rounds, ms "
              "synchronized (back to back); ratio: the first provider's time over this one's")
        for n in names:
            s = summary[n]
            print(f"{shape:16s} {n:24s} {s['synchronized']:8.3f} ({s['back_to_back']:8.3f})  "
                  f"{first['synchronized'] / s['synchronized']:.3f}x ({first['back_to_back'] / s['back_to_back']:.3f}x)"
                  f"  rounds: {times[n]['synchronized']} ({times[n]['back_to_back']})")
        result["shapes"][shape] = {"rounds": times, "median": summary}
        del runs, every, experts
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
