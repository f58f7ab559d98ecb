"""The MegaKernel layer (forward + backward of uniep.moe_experts) with the GEMMs' tiles loaded by pointer loads
and by tensor descriptors (config.tma: the row GEMMs; tma_weight_grad: the weight gradients too), alternating,
on the same inputs; checks that the variants give the same bits.

    python benchmarks/probes/tma_probe.py --shapes mixtral,qwen3-30b-a3b,olmoe [--tokens 8192] [--rounds 3]

``--grouped-mm`` compares instead the GEMM implementations (GemmConfig.grouped_mm): Triton for every GEMM, the
heuristics, torch._grouped_mm for every GEMM, and the heuristics with the up projection by Triton.
``--reuse-saved`` runs the backward in place, as the backend's compiled layers do.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main():
    from bench_moe_layer import SHAPES, make_inputs

    import uniep_dynamo  # noqa: F401 -- registers the ops
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec
    from uniep_dynamo.tuner import time_cuda

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b,olmoe")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timings of each variant")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--loops", action="store_true",
                        help="compare instead: the heuristics, and every GEMM on a persistent grid (a program per SM) "
                             "with Triton's flatten loop option, with and without the heuristics' tma")
    parser.add_argument("--grouped-mm", action="store_true",
                        help="compare instead the GEMM implementations (Triton, torch._grouped_mm, the heuristics' mix)")
    parser.add_argument("--reuse-saved", action="store_true",
                        help="the in-place backward (spec.reuse_saved), as the backend's compiled layers run it")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tma_probe.json"))
    args = parser.parse_args()
    dtype, dev = torch.bfloat16, "cuda"
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype, reuse_saved=args.reuse_saved).encode()
    results = []
    for name in args.shapes.split(","):
        hidden, inter, experts, top_k = SHAPES[name.split("@")[0]]
        tokens = int(name.split("@")[1]) if "@" in name else args.tokens
        x, ids, w, dy = make_inputs(hidden, inter, experts, top_k, tokens, dtype, dev)
        w_up = (torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02)
        w_down = (torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w_up, w_down)]
        base = dataclasses.replace(kconfig.heuristic_config(tokens * top_k, experts, hidden, inter), tma=False,
                                   tma_weight_grad=False)
        if args.grouped_mm:
            heuristic = kconfig.heuristic_config(tokens * top_k, experts, hidden, inter)
            base = heuristic.replace_gemms(grouped_mm=False)
            variants = {"triton": base, "heuristics": heuristic, "grouped_mm": heuristic.replace_gemms(grouped_mm=True),
                        "heuristics, up by triton": dataclasses.replace(
                            heuristic, up=dataclasses.replace(heuristic.up, grouped_mm=False))}
        elif args.loops:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            loops = base.replace_gemms(num_programs=sms, flatten=True)
            heuristic = kconfig.heuristic_config(tokens * top_k, experts, hidden, inter)
            variants = {"pointer loads": base, "heuristics": heuristic, "persistent + flatten": loops,
                        "persistent + flatten, heuristics' tma": dataclasses.replace(loops, tma=heuristic.tma)}
        else:
            variants = {"pointer loads": base, "tensor descriptors": dataclasses.replace(base, tma=True),
                        "tensor descriptors, weight gradients too": dataclasses.replace(base, tma=True,
                                                                                        tma_weight_grad=True)}

        def step(cfg):
            for t in leaves:
                t.grad = None
            with kconfig.use_config(cfg):
                out = torch.ops.uniep.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], None, None, [],
                                                  spec)[0]
                out.backward(dy)
            return [out.detach()] + [t.grad for t in leaves]

        expected = step(base)
        same = {k: all(torch.equal(a, b) for a, b in zip(step(cfg), expected)) for k, cfg in variants.items()}
        times = {k: [] for k in variants}
        for _ in range(args.rounds):
            for k, cfg in variants.items():
                times[k].append(time_cuda(lambda: step(cfg), args.iters, 2))
        flops = 6 * tokens * top_k * hidden * 3 * inter  # forward 2*3 GEMM terms, backward twice that
        row = {"shape": name, "tokens": tokens, "bitwise_same": same, "reuse_saved": args.reuse_saved,
               "ms": {k: round(min(v), 3) for k, v in times.items()},
               "tflops": {k: round(flops / min(v) / 1e9, 1) for k, v in times.items()}}
        print(json.dumps(row), flush=True)
        results.append(row)
        del x, ids, w, dy, w_up, w_down, leaves, expected
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
