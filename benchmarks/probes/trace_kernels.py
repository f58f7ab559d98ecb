"""Kernel time in a chrome trace that ep_exchange_probe.py wrote (``--trace-dir``; its profiled steps are 2): per step,
all kernels, the NCCL kernels (their time includes waiting for the peers) and the rest, and each named kernel's
durations in launch order.

    python benchmarks/probes/trace_kernels.py TRACE.json.gz [--steps 2] [--kernels _combine,_gather_rows]
"""
from __future__ import annotations

import argparse
import gzip
import json


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--kernels", default="_combine,_gather_rows,vectorized_elementwise_kernel")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        kernels = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    total = sum(e["dur"] for e in kernels) / args.steps
    nccl = sum(e["dur"] for e in kernels if "nccl" in e["name"]) / args.steps
    print(f"{args.trace}: kernels {total:.0f} µs/step, NCCL {nccl:.0f}, the rest {total - nccl:.0f}")
    for name in filter(None, args.kernels.split(",")):
        print(f"  {name}: " + " ".join(f"{e['dur']:.0f}" for e in kernels if name in e["name"]))


if __name__ == "__main__":
    main()
