"""Probe: how long the host spends in torch symmetric memory's barrier (the overlapped EP layer's window barrier).

Spawns --world ranks with one symmetric buffer each. On rank 0 it prints the host time of one barrier call (median
of --iters), torch's ``handle.barrier(channel=0)`` and uniep's window barrier (ep_overlap._Window.barrier), in three
situations: the GPU idle, the GPU busy with
--sleep-ms of queued work (torch.cuda._sleep) before the call, and after 50 queued small kernels; and the
Python threads alive in the process (a thread that holds the GIL delays a call that released it).

    python benchmarks/probes/barrier_probe.py --world 4
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _worker(rank, world, port, args):
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        buf = symm_mem.empty(1 << 20, dtype=torch.bfloat16, device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        small = torch.zeros(1024, device=device)
        cycles = int(_cycles_per_ms() * args.sleep_ms)
        rows = {}
        from uniep_dynamo.ep_overlap import _window

        window = _window(group, 64, 64, torch.bfloat16, device)
        barriers = {"torch": lambda: handle.barrier(channel=0), "uniep": window.barrier}
        for name, barrier in barriers.items():
            barrier()  # compiled, warm
            for situation in ("idle", "busy", "small_kernels"):
                times = []
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    dist.barrier()
                    if situation == "busy":
                        torch.cuda._sleep(cycles)
                    elif situation == "small_kernels":
                        for _ in range(50):
                            small.add_(1)
                    t = time.perf_counter()
                    barrier()
                    times.append((time.perf_counter() - t) * 1e6)
                torch.cuda.synchronize()
                times.sort()
                rows[(name, situation)] = times[len(times) // 2]
        if rank == 0:
            print(f"barrier host time, median of {args.iters} (us; busy: {args.sleep_ms} ms queued before it):")
            for name in barriers:
                print(f"  {name:6s} " + ", ".join(f"{s} {rows[(name, s)]:.1f}" for s in ("idle", "busy",
                                                                                         "small_kernels")))
            print("python threads:", [t.name for t in threading.enumerate()], flush=True)
        dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=2.0)
    args = p.parse_args()
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
