"""How long the host takes to launch one grouped GEMM: QuACK's public entry point, uniep's direct launch of the same
compiled kernel (kernels/quack_gemm.py, ``UNIEP_QUACK_DIRECT``), and torch._grouped_mm (issue 39).

A synchronized step waits for its host wherever the GPU's queue runs dry, so the host's time per launch is part of
the step's time. For each of the six GEMMs of one layer (quack_probe.py's operands, the up projection and its weight
gradient with the row gather inside QuACK), at the heuristics' config of each (config.QUACK_CONFIGS): the host µs a
call (the median of --rounds rounds of --calls calls issued back to back, each round after a synchronization), the
GPU ms of one call, and whether the direct launch's output equals the entry point's bit for bit.

    python benchmarks/probes/quack_launch_probe.py --shape qwen3-30b-a3b
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import SHAPES, make_inputs  # noqa: E402
from quack_probe import gemms, out_like, plan  # noqa: E402

from uniep_dynamo.kernels import config as kconfig  # noqa: E402
from uniep_dynamo.kernels import quack_gemm  # noqa: E402
from uniep_dynamo.tuner import time_cuda  # noqa: E402


def host_us(call, calls, rounds):
    """Median host µs a call over ``rounds`` rounds of ``calls`` calls issued back to back."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def launches(kw, E, config):
    """{path: call} for the GEMM of QuACK's keyword arguments ``kw``, writing into one output each."""
    rest = {k: v for k, v in kw.items() if k not in ("A", "B")}
    out = {"direct": out_like(kw, E), "entry_point": out_like(kw, E)}
    fn = quack_gemm.rows if "cu_seqlens_m" in kw else quack_gemm.wgrad
    cu = rest.get("cu_seqlens_m", rest.get("cu_seqlens_k"))

    def via(path):
        def call():
            os.environ["UNIEP_QUACK_DIRECT"] = "1" if path == "direct" else "0"
            fn(kw["A"], kw["B"], out[path], cu, config, a_idx=rest.get("A_idx"))
        return call
    return {p: via(p) for p in out}, out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quack_launch_probe.json"))
    args = parser.parse_args()
    reason = quack_gemm.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        sys.exit(f"quack_launch_probe: QuACK does not run here: {reason}")
    H, I, E, K = SHAPES[args.shape]
    x, ids, _, _ = make_inputs(H, I, E, K, args.tokens, torch.bfloat16, "cuda")
    from bench_moe_layer import hf_experts

    experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
    tok, cu = plan(ids, E)
    rows = []
    for name, (grouped, _, kw, _) in gemms(x, tok, cu, experts.gate_up_proj.data, experts.down_proj.data).items():
        config = kconfig.QUACK_CONFIGS[name]
        if "A_idx" in kw and not quack_gemm.gathers(config):
            kw = {k: v for k, v in kw.items() if k != "A_idx"}
        calls, outs = launches(kw, E, config)
        for call in calls.values():
            call()  # compile (or load) once
        row = {"gemm": name, "config": config, "gather": "A_idx" in kw,
               "host_us": {p: round(host_us(c, args.calls, args.rounds), 1) for p, c in calls.items()},
               "gpu_ms": {p: round(time_cuda(c, 10, 3), 4) for p, c in calls.items()},
               "bitwise_direct_vs_entry_point": torch.equal(outs["direct"], outs["entry_point"])}
        if "A_idx" not in kw:
            row["host_us"]["torch_grouped_mm"] = round(host_us(grouped, args.calls, args.rounds), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.environ.pop("UNIEP_QUACK_DIRECT", None)
    total = {p: round(sum(r["host_us"][p] for r in rows), 1) for p in ("direct", "entry_point")}
    print(f"host µs for the six GEMMs: {total}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "shape": args.shape, "tokens": args.tokens, "rows": rows,
                   "total_host_us": total}, f, indent=1)


if __name__ == "__main__":
    main()
