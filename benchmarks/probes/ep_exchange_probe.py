"""Where the compiled uniep.ep_exchange layer spends its time: bench_ep's EP layer compiled with uniep (or with
options={"overlap_ep": False}), a few steps under the torch profiler on rank 0, the top entries by host and by
device time, and how many overlapped phases ran per step.

    python benchmarks/probes/ep_exchange_probe.py --world 2 --shape qwen3-30b-a3b [--sequential]
"""
import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _worker(rank, world, port, args):
    from bench_ep import SHAPES, _layer_class

    from uniep_dynamo import ep_overlap
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        hidden, inter, experts, top_k = SHAPES[args.shape]
        torch.manual_seed(0)
        layer = _layer_class()[0](hidden, inter, experts, top_k, torch.bfloat16).to(device)
        x = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        run = torch.compile(layer, backend="uniep", options={"overlap_ep": not args.sequential})
        phases = [0]
        inner = ep_overlap._exchange

        def counted(*a, **k):
            phases[0] += 1
            return inner(*a, **k)
        ep_overlap._exchange = counted

        def step():
            layer.zero_grad(set_to_none=True)
            run(x).backward(grad)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        phases[0] = 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"{args.shape} world {world} {'sequential' if args.sequential else 'exchange'}: "
                  f"{start.elapsed_time(end) / 5:.3f} ms/step, {phases[0] / 5:.1f} overlapped phases/step", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            table = prof.key_averages()
            print(table.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
            print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--sequential", action="store_true")
    args = parser.parse_args()
    from uniep_dynamo.ep import free_port
    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
