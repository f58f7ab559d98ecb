"""The uniep experts layer (bench_moe_layer.py's uniep provider, forward + backward, T = 8192) with the heuristic
config against the same config with per_expert_mm off on every GEMM, interleaved for ROUNDS rounds (env, default 3):
ms synchronized (median of 30) and back to back (mean of 30) per round, and whether the results are bitwise equal.

    ROUNDS=4 python benchmarks/probes/per_expert_ab_probe.py mixtral
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_moe_layer as bench  # noqa: E402
from uniep_dynamo.kernels import config as kc  # noqa: E402
from uniep_dynamo.tuner import time_cuda  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "mixtral"
H, I, E, K = bench.SHAPES[shape]; T = 8192
experts = bench.hf_experts(H, I, E, K, torch.bfloat16, "cuda")
x, ids, w, g = bench.make_inputs(H, I, E, K, T, torch.bfloat16, "cuda")
provs = bench.providers(experts)
run = bench.step(provs["uniep"], experts, x, ids, w, g)
base = kc.heuristic_config(T * K, E, H, I)
variants = {"heuristic": base, "none": base.replace_gemms(per_expert_mm=False)}
res = {k: [] for k in variants}
outs = {}
for rnd in range(int(os.environ.get('ROUNDS', 3))):
    for name, cfg in variants.items():
        with kc.use_config(cfg):
            run()
            res[name].append((round(time_cuda(run, 30, 2), 3), round(bench.time_cuda_back_to_back(run, 30), 3)))
            if rnd == 0:
                outs[name] = [t.detach().clone() for t in run()]
same = {n: all(torch.equal(a, b) for a, b in zip(outs[n], outs["none"])) for n in outs}
print(json.dumps({"shape": shape, "ms (sync, back to back) per round": res, "bitwise_equal_to_none": same}, indent=1))
