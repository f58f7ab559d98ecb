"""Probe: where the overlapped EP layer's time goes, next to the single-GPU MegaKernel on the same rows.

Spawns --world ranks; each holds T tokens and E / world experts of one shape. For each variant it times
--iters steps (forward + backward, CUDA events, median), measures the host time of one step (from the
call to the return of backward, nothing synchronized after it), and profiles 3 steps on rank 0 with the
torch profiler: a chrome trace per variant into --out-dir and a summary of device time per kernel name.
With --cprofile N, N more steps run under cProfile on rank 0 (the host functions by own time).

    python benchmarks/probes/ep_profile_probe.py --world 2 --shape qwen3-30b-a3b --out-dir /tmp/prof
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_ep import SHAPES  # noqa: E402

KINDS = {"overlap": {}, "compute_only": {"timing": "compute"}, "comm_only": {"timing": "comm"}, "single_gpu": None}


def _variant(name):
    """'kind' or 'kind:knob=value:knob=value' (OverlapConfig knobs, integers; booleans 0/1) -> knobs or None."""
    kind, *pairs = name.split(":")
    if KINDS[kind] is None:
        return None
    knobs = dict(KINDS[kind])
    for pair in pairs:
        key, value = pair.split("=")
        knobs[key] = bool(int(value)) if key in ("copy_engine", "copy_kernel", "overlap") else int(value)
    return knobs


def _worker(rank, world, port, args):
    from uniep_dynamo import ops
    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        from uniep_dynamo.ep_overlap import OverlapConfig, ep_experts_overlapped
        from uniep_dynamo.kernels import gate_program
        from uniep_dynamo.spec import ExpertsSpec

        hidden, inter, experts, top_k = SHAPES[args.shape]
        dtype = torch.bfloat16
        local = experts // world
        g = torch.Generator().manual_seed(rank)
        w_up = (torch.randn(local, hidden, 2 * inter, generator=g) * hidden ** -0.5).to(device, dtype).requires_grad_()
        w_down = (torch.randn(local, inter, hidden, generator=g) * inter ** -0.5).to(device, dtype).requires_grad_()
        x = torch.randn(args.tokens, hidden, generator=g).to(device, dtype).requires_grad_()
        logits = torch.randn(args.tokens, experts, generator=g).to(device)
        weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
        weights = weights.to(dtype).requires_grad_()
        grad = torch.randn(args.tokens, hidden, generator=g).to(device, dtype)
        spec = ExpertsSpec("io", "io", gate_program.encode("chunk", gate_program.SILU_GLU_EXPR), dtype).encode()
        # single GPU: the same rows' work on one GPU is T tokens over all E experts
        full_up = torch.randn(experts, hidden, 2 * inter, generator=g).mul_(hidden ** -0.5).to(device, dtype)
        full_down = torch.randn(experts, inter, hidden, generator=g).mul_(inter ** -0.5).to(device, dtype)
        full_up.requires_grad_(); full_down.requires_grad_()
        results = {}
        for name in args.variants.split(","):
            knobs = _variant(name)
            if knobs is None:
                def step():
                    for t in (x, weights, full_up, full_down):
                        t.grad = None
                    out = ops.moe_experts_out(x, ids, weights, full_up, full_down, None, None, spec)
                    out.backward(grad)
            else:
                config = OverlapConfig(**{"chunks": args.chunks, **knobs})

                def step():
                    for t in (x, weights, w_up, w_down):
                        t.grad = None
                    out = ep_experts_overlapped(x, ids, weights, w_up, w_down, None, None, spec, knobs=config)
                    out.backward(grad)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            times, host = [], []
            for _ in range(args.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t = time.perf_counter()
                step()
                host.append((time.perf_counter() - t) * 1e3)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            times.sort(); host.sort()
            dist.barrier()
            results[name] = {"ms": times[len(times) // 2], "host_ms": host[len(host) // 2]}
            summary = f"== {name}: {results[name]['ms']:.3f} ms (host {results[name]['host_ms']:.3f} ms)"
            if args.cprofile and rank == 0:
                import cProfile
                import io
                import pstats

                with cProfile.Profile() as cprof:
                    for _ in range(args.cprofile):
                        step()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(cprof, stream=text).sort_stats("tottime").print_stats(args.cprofile_rows)
                cumulative = io.StringIO()
                pstats.Stats(cprof, stream=cumulative).sort_stats("cumulative").print_stats("uniep_dynamo",
                                                                                            args.cprofile_rows)
                print(f"{summary}; cProfile of {args.cprofile} steps, by own time:\n"
                      + text.getvalue().split("ncalls", 1)[-1][:6000]
                      + "\nuniep's functions by cumulative time:\n" + cumulative.getvalue().split("ncalls", 1)[-1][:5000],
                      flush=True)
            elif args.cprofile:
                for _ in range(args.cprofile):
                    step()
                torch.cuda.synchronize()
            if args.no_profile:
                if rank == 0:
                    print(summary, flush=True)
                continue
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            if rank == 0:
                label = name.replace(":", "_").replace("=", "")
                prof.export_chrome_trace(os.path.join(args.out_dir, f"{args.shape}-w{world}-{label}.json"))
                print(summary, flush=True)
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18,
                                                max_name_column_width=60), flush=True)
            dist.barrier()
        if rank == 0:
            with open(os.path.join(args.out_dir, f"{args.shape}-w{world}-summary.json"), "w") as f:
                json.dump(results, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="single_gpu,compute_only,overlap:copy_engine=0:copy_kernel=1,"
                   "comm_only:copy_engine=0:copy_kernel=1",
                   help="comma-separated: kind[:knob=value...], kind one of " + ", ".join(KINDS))
    p.add_argument("--no-profile", action="store_true", help="time only")
    p.add_argument("--cprofile", type=int, default=0, help="run this many steps under cProfile on rank 0 per variant "
                   "and print the host functions that took the most time")
    p.add_argument("--cprofile-rows", type=int, default=30)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
