"""Where an EP layer's step spends its time: bench_ep's EP layer under several providers, a few steps under the
torch profiler on rank 0 (the top entries by host time, the GPU's busy time per stream, and the step's idle
gaps), optionally a chrome trace per provider and a cProfile of the host.

    python benchmarks/probes/ep_exchange_probe.py --world 2 --shape qwen3-30b-a3b \
        --modes inductor,sequential,exchange,direct [--trace-dir DIR] [--cprofile] [--stack]

Modes: inductor (torch.compile), sequential (backend="uniep", overlap_ep off), exchange (backend="uniep",
overlap_ep on), direct (the router compiled with uniep, then ep_experts_overlapped with its default knobs);
sequential_nostash and exchange_nostash run the same graphs with the dispatch's hand-overs turned off (its count
table for the exchange, its inverse order for the combine): the exchange all-gathers its claims and reads them
back, the combine inverts the order again, as before they existed. exchange_wgc and direct_wgc run exchange and
direct with OverlapConfig.weight_grads_last=False (the backward's weight gradients chunk by chunk, instead of one
GEMM each after the chunks). A mode with the suffix _triton runs every GEMM of uniep's by Triton (the tile config's
grouped_mm knob off), as the overlapped chunks did before they took torch._grouped_mm.

With --rounds N > 1 every mode is compiled first, then timed in N alternating rounds (the minimum is reported
beside each round), so that a slow or fast stretch of the machine does not favour one mode.
"""
import argparse
import contextlib
import cProfile
import gc
import gzip
import io
import os
import pstats
import shutil
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _gpu_summary(prof, wall_ms: float, steps: int) -> str:
    """GPU busy time per stream and the union over streams, per step, against the wall time; the longest idle
    gaps of the union."""
    spans, streams = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            start, end = e.time_range.start, e.time_range.end
            spans.append((start, end))
            key = getattr(e, "device_resource_id", None)
            streams[key] = streams.get(key, 0.0) + (end - start)
    if not spans:
        return "no device events"
    spans.sort()
    busy, gaps, (cur_s, cur_e) = 0.0, [], spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    first = spans[0][0]
    lines = [f"  wall {wall_ms:.3f} ms/step; GPU busy (any stream) {busy / 1000 / steps:.3f} ms/step; "
             f"device span {(cur_e - first) / 1000 / steps:.3f} ms/step"]
    for key, us in sorted(streams.items(), key=lambda kv: -kv[1]):
        lines.append(f"  stream {key}: {us / 1000 / steps:.3f} ms/step of kernels and copies")
    gaps.sort(reverse=True)
    total_gap = sum(g for g, _ in gaps)
    lines.append(f"  idle gaps: {len(gaps)} totalling {total_gap / 1000 / steps:.3f} ms/step; longest (us, at us from "
                 "the first event): " + ", ".join(f"{g:.0f}@{at - first:.0f}" for g, at in gaps[:12]))
    return "\n".join(lines)


_COMPILED: dict = {}


@contextlib.contextmanager
def _triton_gemms():
    """Every uniep GEMM by Triton: the config the ops read, with the grouped_mm knob off."""
    from uniep_dynamo.kernels import config as config_mod

    original = config_mod.current_config
    config_mod.current_config = lambda *a, **k: original(*a, **k).replace_gemms(grouped_mm=False)
    try:
        yield
    finally:
        config_mod.current_config = original


def _step(mode, layer, x, grad):
    """One training step of the layer under ``mode`` (compiled and run 3 times here). A mode and its _nostash
    twin share one compiled layer: the hand-overs are switched at run time."""
    from bench_ep import _overlapped_run

    from uniep_dynamo.ep import custom_ops, plan

    triton_only = mode.endswith("_triton")
    base = mode.removesuffix("_triton").removesuffix("_nostash")
    if base not in _COMPILED:
        if base == "inductor":
            _COMPILED[base] = torch.compile(layer)
        elif base in ("sequential", "exchange"):
            _COMPILED[base] = torch.compile(layer, backend="uniep", options={"overlap_ep": base == "exchange"})
        elif base == "exchange_wgc":
            _COMPILED[base] = torch.compile(layer, backend="uniep", options={
                "overlap_ep": True, "ep_knobs": {"weight_grads_last": False}})
        elif base in ("direct", "direct_wgc"):
            _COMPILED[base] = _overlapped_run(layer, 4, None, weight_grads_last=base == "direct")
        else:
            raise SystemExit(f"unknown mode {mode}")
    run = _COMPILED[base]
    stash = not mode.removesuffix("_triton").endswith("_nostash")

    def step():
        kept = plan.MAX_COUNT_TABLES, custom_ops.MAX_INVERSES
        if not stash:
            plan.MAX_COUNT_TABLES = custom_ops.MAX_INVERSES = 0
        try:
            with _triton_gemms() if triton_only else contextlib.nullcontext():
                layer.zero_grad(set_to_none=True)
                x.grad = None
                run(x).backward(grad)
        finally:
            plan.MAX_COUNT_TABLES, custom_ops.MAX_INVERSES = kept
    for _ in range(3):
        step()
    return step


def _worker(rank, world, port, args):
    from bench_ep import SHAPES, _layer_class
    from bench_moe_layer import time_cuda_back_to_back

    from uniep_dynamo.ep import local_rank

    with local_rank(rank, world, port) as device:
        hidden, inter, experts, top_k = SHAPES[args.shape]
        torch.manual_seed(0)
        layer = _layer_class()[0](hidden, inter, experts, top_k, torch.bfloat16).to(device)
        x = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        modes = args.modes.split(",")
        torch._dynamo.reset()
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        steps = {mode: _step(mode, layer, x, grad) for mode in modes}  # compiled and warmed up
        rounds = {mode: [] for mode in modes}
        collections = {mode: [0, 0, 0] for mode in modes}  # the collector's passes per generation in each mode's rounds
        if args.no_gc:  # Python's cyclic collector off while timing (a pause on one rank stalls every rank)
            gc.collect()
            gc.disable()
        for _ in range(args.rounds):
            for mode in modes:
                before = [g["collections"] for g in gc.get_stats()]
                rounds[mode].append(time_cuda_back_to_back(steps[mode], args.steps))
                for g, (b, a) in enumerate(zip(before, [g["collections"] for g in gc.get_stats()])):
                    collections[mode][g] += a - b
        gc.enable()
        if rank == 0 and args.rounds > 1:
            for mode in modes:
                print(f"== {args.shape} world {world} {mode}: rounds " + ", ".join(f"{t:.3f}" for t in rounds[mode])
                      + f" ms/step; min {min(rounds[mode]):.3f}; garbage collections (gen 0/1/2) "
                      + "/".join(map(str, collections[mode])), flush=True)
        for mode in modes if not args.no_profile else ():
            step, wall = steps[mode], min(rounds[mode])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA],
                                        with_stack=args.stack) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
            if rank == 0:
                print(f"== {args.shape} world {world} {mode}: {wall:.3f} ms/step", flush=True)
                try:
                    print(_gpu_summary(prof, wall, 2), flush=True)
                except Exception as exc:  # noqa: BLE001 -- the profiler's event API differs between versions
                    print(f"  no GPU summary: {exc!r}", flush=True)
                table = prof.key_averages()
                print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    path = os.path.join(args.trace_dir, f"{args.shape}-w{world}-{mode}.json")
                    prof.export_chrome_trace(path)
                    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    os.remove(path)
            if args.cprofile and mode != "inductor":
                torch.cuda.synchronize()
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                profiler.disable()
                if rank == 0:
                    out = io.StringIO()
                    stats = pstats.Stats(profiler, stream=out)
                    stats.sort_stats("tottime").print_stats(30)
                    stats.sort_stats("cumtime").print_stats(45)
                    print(f"-- cProfile, {mode}, 3 steps", flush=True)
                    print(out.getvalue(), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--modes", default="sequential,exchange")
    parser.add_argument("--trace-dir", default="")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--no-gc", action="store_true", help="the cyclic garbage collector off in the timed rounds")
    parser.add_argument("--no-profile", action="store_true", help="the timed rounds only")
    parser.add_argument("--stack", action="store_true",
                        help="record Python calls in the profiled steps (in the chrome traces: python_function)")
    args = parser.parse_args()
    from uniep_dynamo.ep import free_port
    mp.spawn(_worker, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
