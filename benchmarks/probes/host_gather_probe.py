"""What one all-gather of a token count over gloo costs the host (issue 37): the device plan's per-call
``host_tokens`` (ep/device_plan.py) is one such all-gather between the EP group's processes.

Spawns --world processes on this host (gloo, no GPU), all-gathers one int64 --iters times after a warm-up and prints
the median and 90th percentile of one call's wall time on rank 0.

    python benchmarks/probes/host_gather_probe.py --world 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))


def _worker(rank, world, port, iters):
    from uniep_dynamo.ep.plan import all_gather_flat

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out, mine = torch.empty(world, dtype=torch.int64), torch.tensor([8192], dtype=torch.int64)
        for _ in range(50):
            all_gather_flat(out, mine, dist.group.WORLD)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            all_gather_flat(out, mine, dist.group.WORLD)
            times.append(time.perf_counter() - start)
        times.sort()
        if rank == 0:
            print(f"gloo all-gather of one int64, {world} processes, {iters} calls: median "
                  f"{times[len(times) // 2] * 1e6:.1f} us, p90 {times[len(times) * 9 // 10] * 1e6:.1f} us")
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args.iters), nprocs=args.world)


if __name__ == "__main__":
    main()
