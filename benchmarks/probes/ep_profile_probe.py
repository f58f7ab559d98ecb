"""Probe: where the overlapped EP layer's time goes, next to the single-GPU MegaKernel on the same rows.

Spawns --world ranks; each holds T tokens and E / world experts of one shape. For each variant it times
--iters steps (forward + backward, CUDA events, median), measures the host time of one step (from the
call to the return of backward, nothing synchronized after it), and profiles 3 steps on rank 0 with the
torch profiler: a chrome trace per variant into --out-dir and a summary of device time per kernel name.
With --cprofile N, N more steps run under cProfile on rank 0 (the host functions by own time). With
--barriers, every rank times each window barrier of the timed steps on its GPU (CUDA events around it: how
long its GPU waited for the slowest peer) and rank 0 prints them per rank, with each rank's step and host time.
--pin binds each rank to its own block of cores. --interleave runs the variants' steps in turn, round by round
(each step's time is its slowest rank's), so that drifts fall on every variant alike; with --host-clock it also
prints the host time a step of each function in HOST_FUNCTIONS, per rank.

    python benchmarks/probes/ep_profile_probe.py --world 2 --shape qwen3-30b-a3b --out-dir /tmp/prof
"""
from __future__ import annotations

import argparse
import contextlib
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
        flags = ("copy_engine", "copy_kernel", "overlap", "push_in_gemm", "weight_grads_last", "batch_copies", "taper",
                 "copy_back_beside", "gemm_carveout")
        knobs[key] = bool(int(value)) if key in flags else int(value)
    return knobs


class _timed_barriers:
    """Within it, every window barrier is timed on the GPU, (start, end) event pairs appended to ``marks``, and on
    the host (``host``), as is the count table's all-gather and copy to the host (``host_table``). marks=None:
    nothing is timed."""

    def __init__(self, marks):
        self.marks = marks

    def __enter__(self):
        from uniep_dynamo.ep import overlap, transfer

        self.window, self.plain = transfer.Window, transfer.Window.barrier
        if self.marks is None:
            return self
        plain, marks = self.plain, self.marks

        def barrier(win):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t = time.perf_counter()
            plain(win)
            host.append((time.perf_counter() - t) * 1e3)
            b.record()
            marks.append((a, b))

        def table(*args, **kwargs):
            t = time.perf_counter()
            try:
                return plain_table(*args, **kwargs)
            finally:
                host_table.append((time.perf_counter() - t) * 1e3)
        host, host_table = self.host, self.host_table = [], []
        plain_table = self.plain_table = overlap.count_table
        self.window.barrier, overlap.count_table = barrier, table
        return self

    def __exit__(self, *exc):
        from uniep_dynamo.ep import overlap

        self.window.barrier = self.plain
        if self.marks is not None:
            overlap.count_table = self.plain_table


# (module or class path, attribute): the host functions --host-clock times, each inclusive of what it calls
HOST_FUNCTIONS = [
    # (a function is wrapped where its callers look it up: the ep modules import each other's names)
    ("uniep_dynamo.ep.overlap", "_plan"), ("uniep_dynamo.ep.overlap", "count_table"),
    ("uniep_dynamo.ep.layout.Layout", "__init__"), ("uniep_dynamo.ep.layout.Layout", "to_device"),
    ("uniep_dynamo.ep.layout.Layout", "destinations"), ("uniep_dynamo.ep.pipeline", "window"),
    ("uniep_dynamo.ep.chunks.Chunks", "__init__"), ("uniep_dynamo.ep.chunks.Chunks", "layer"),
    ("uniep_dynamo.ep.overlap", "forward_phase"), ("uniep_dynamo.ep.overlap", "backward_phase"),
    ("uniep_dynamo.ep.pipeline", "start_exchange"), ("uniep_dynamo.ep.chunks.Chunks", "forward"),
    ("uniep_dynamo.ep.chunks.Chunks", "backward"), ("uniep_dynamo.ep.chunks.Chunks", "weight_grads"),
    ("uniep_dynamo.ep.transfer.Window", "barrier"), ("uniep_dynamo.ep.transfer.Streams", "__init__"),
    ("uniep_dynamo.ep.transfer.Streams", "record"), ("uniep_dynamo.ep.transfer.Streams", "wait"),
    ("uniep_dynamo.kernels.triton_routing", "routing_plan"), ("uniep_dynamo.kernels.triton_routing", "combine"),
    ("uniep_dynamo.kernels.triton_routing", "gather_rows"),
    ("uniep_dynamo.kernels.triton_routing", "routing_weight_grad"),
    ("uniep_dynamo.kernels.triton_transfer", "copy_segments"), ("uniep_dynamo.kernels.triton_transfer", "layout_tables"),
    ("uniep_dynamo.kernels.megakernel.Layer", "__init__"), ("uniep_dynamo.kernels.megakernel", "rows_gemm"),
    ("uniep_dynamo.kernels.megakernel", "weight_grad"), ("uniep_dynamo.kernels.megakernel", "_act_forward"),
    ("uniep_dynamo.kernels.megakernel", "act_backward"),
    ("triton.runtime.jit.JITFunction", "run"), ("torch", "_grouped_mm"),
]


class _host_clock:
    """Within it, each of HOST_FUNCTIONS adds its host time (inclusive; a call inside a call of the same function
    is not counted twice) and its calls to ``totals[name] = [ms, calls]``, from every thread."""

    def __init__(self, totals):
        self.totals, self.saved = totals, []

    def __enter__(self):
        import importlib
        import threading

        depth = threading.local()
        for path, attr in HOST_FUNCTIONS:
            try:
                owner = importlib.import_module(path)
            except ImportError:
                mod, _, cls = path.rpartition(".")
                owner = getattr(importlib.import_module(mod), cls)
            if not hasattr(owner, attr):  # a tree without it (the probe times other commits' trees too)
                continue
            plain = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            name = f"{path.rsplit('.', 1)[-1]}.{attr}"
            self.totals.setdefault(name, [0.0, 0])

            def timed(*a, _plain=plain, _name=name, **k):
                level = getattr(depth, _name, 0)
                setattr(depth, _name, level + 1)
                t = time.perf_counter()
                try:
                    return _plain(*a, **k)
                finally:
                    setattr(depth, _name, level)
                    if level == 0:
                        entry = self.totals[_name]
                        entry[0] += (time.perf_counter() - t) * 1e3
                        entry[1] += 1
            self.saved.append((owner, attr, plain))
            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc):
        for owner, attr, plain in reversed(self.saved):
            setattr(owner, attr, plain)


def _worker(rank, world, port, args):
    from uniep_dynamo import ops
    from uniep_dynamo.ep import local_rank

    if args.pin:  # this rank's process (every thread it starts after this) on its own block of cores
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // world
        os.sched_setaffinity(0, cores[rank * per:(rank + 1) * per])
    with local_rank(rank, world, port) as device:
        from uniep_dynamo.ep import OverlapConfig, ep_experts_overlapped
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

        def make_step(name):
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
            return step

        if args.interleave:
            _interleaved(rank, world, args, make_step)
            return
        for name in args.variants.split(","):
            step = make_step(name)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            times, host, waits, host_waits = [], [], [], []
            for _ in range(args.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                marks = []
                with _timed_barriers(marks if args.barriers else None) as timed:
                    e0.record()
                    t = time.perf_counter()
                    step()
                    host.append((time.perf_counter() - t) * 1e3)
                    e1.record()
                    torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
                waits.append([a.elapsed_time(b) for a, b in marks])
                if args.barriers:
                    host_waits.append((sum(timed.host), sum(timed.host_table)))
            step_ms, host_ms = sorted(times)[len(times) // 2], sorted(host)[len(host) // 2]
            dist.barrier()
            results[name] = {"ms": step_ms, "host_ms": host_ms}
            summary = f"== {name}: {results[name]['ms']:.3f} ms (host {results[name]['host_ms']:.3f} ms)"
            if args.barriers:
                calls = min(len(w) for w in waits)
                mine = {"ms": step_ms, "host_ms": host_ms,
                        "barrier_ms": [sorted(w[i] for w in waits)[len(waits) // 2] for i in range(calls)],
                        "host_in_barriers_ms": sorted(h[0] for h in host_waits)[len(host_waits) // 2],
                        "host_in_table_ms": sorted(h[1] for h in host_waits)[len(host_waits) // 2]}
                every = [None] * world
                dist.all_gather_object(every, mine)
                results[name]["ranks"] = every
                if rank == 0:
                    print(f"{summary}; per rank: step ms, host ms, host ms in the barrier calls and in the count "
                          f"table (all-gather and copy to the host), median GPU wait in each barrier of a step (ms)")
                    for r, m in enumerate(every):
                        print(f"   rank {r}: {m['ms']:7.3f} {m['host_ms']:7.3f} {m['host_in_barriers_ms']:7.3f} "
                              f"{m['host_in_table_ms']:7.3f}  " + " ".join(f"{b:6.3f}" for b in m["barrier_ms"]),
                              flush=True)
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


def _interleaved(rank, world, args, make_step):
    """--interleave: the variants' steps in turn, --iters rounds, so that drifts of clocks and hosts fall on all of
    them alike; each step's time is its slowest rank's. With --host-clock, each variant's host time per function."""
    names = list(dict.fromkeys(args.variants.split(",")))
    steps = {name: make_step(name) for name in names}
    for name in names:
        for _ in range(3):
            steps[name]()
    torch.cuda.synchronize()
    dist.barrier()
    times = {name: [] for name in names}
    host = {name: [] for name in names}
    clocks = {name: {} for name in names}
    for _ in range(args.iters):
        for name in names:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with (_host_clock(clocks[name]) if args.host_clock else contextlib.nullcontext()):
                e0.record()
                t = time.perf_counter()
                steps[name]()
                host[name].append((time.perf_counter() - t) * 1e3)
                e1.record()
                torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1))
    every = [None] * world
    dist.all_gather_object(every, {"times": times, "host": host, "clocks": clocks})
    if rank != 0:
        return
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"== interleaved, {args.iters} rounds; ms a step (slowest rank of each step, median), host ms a step "
          "(median of each rank's)")
    result = {}
    for name in names:
        slowest = [max(r["times"][name][i] for r in every) for i in range(args.iters)]
        hosts = [median(r["host"][name]) for r in every]
        result[name] = {"ms": median(slowest), "host_ms": hosts}
        print(f"   {name:40s} {median(slowest):7.3f} ms  (min {min(slowest):.3f})  host " +
              " ".join(f"{h:6.3f}" for h in hosts), flush=True)
    if args.host_clock:
        print("== host ms a step in each function (inclusive), per rank; calls a step")
        funcs = [f for f in every[0]["clocks"][names[0]]]
        for name in names:
            print(f"-- {name}")
            for f in funcs:
                per_rank = [r["clocks"][name].get(f, [0.0, 0]) for r in every]
                if not any(c for _, c in per_rank):
                    continue
                print(f"   {f:36s} " + " ".join(f"{ms / args.iters:6.3f}" for ms, _ in per_rank)
                      + f"   {per_rank[0][1] / args.iters:6.1f}", flush=True)
        result["clocks"] = [r["clocks"] for r in every]
    with open(os.path.join(args.out_dir, f"{args.shape}-w{world}-interleaved.json"), "w") as f:
        json.dump(result, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunks", type=int, default=None, help="default: the library's (OverlapConfig.chunks)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="single_gpu,compute_only,overlap:copy_engine=0:copy_kernel=1,"
                   "comm_only:copy_engine=0:copy_kernel=1",
                   help="comma-separated: kind[:knob=value...], kind one of " + ", ".join(KINDS))
    p.add_argument("--no-profile", action="store_true", help="time only")
    p.add_argument("--cprofile", type=int, default=0, help="run this many steps under cProfile on rank 0 per variant "
                   "and print the host functions that took the most time")
    p.add_argument("--cprofile-rows", type=int, default=30)
    p.add_argument("--barriers", action="store_true", help="time every window barrier on each rank's GPU")
    p.add_argument("--pin", action="store_true", help="bind each rank to its own block of the allowed cores")
    p.add_argument("--interleave", action="store_true", help="run the variants' steps in turn, round by round")
    p.add_argument("--host-clock", action="store_true", help="with --interleave: the host time of each of "
                   "HOST_FUNCTIONS a step, per rank")
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    from uniep_dynamo.ep import free_port

    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
