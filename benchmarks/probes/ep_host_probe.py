"""Host time of one uniep.ep_layer call at world size 1 (a one-rank NCCL group in this process), forward and
backward, beside the single-GPU op uniep.moe_experts on the same inputs (issue 37: "one GPU: the op at world size 1
against the single-GPU op, bitwise; its host time per call"). Median µs a call over --calls calls, the GPU
synchronized before each timed call (outside the timed region), so each call's host time is its own; ep_layer's
forward includes its one host synchronization (the split sizes), so it waits for its own plan kernels and the
count all-gather. Also the synchronizing calls of one call each way (torch.cuda.set_sync_debug_mode("warn")'s
warnings; tests/test_ep_single_rank.py asserts at most one). Providers:

  moe_experts         the single-GPU op
  ep_layer            overlap off (the all-to-alls around the experts op: HF's default, overlap_ep=False)
  ep_layer_overlap    the overlapped exchange (symmetric memory)
  ep_layer_device_plan      the device plan (ep_device_plan=True: the counts on the device, no host synchronization)
  ep_layer_device_pipeline  the device plan's pipeline (ep_device_plan=True with overlap_ep: ep/device_pipeline.py)

    python benchmarks/probes/ep_host_probe.py [--shape qwen3-30b-a3b] [--tokens 8192] [--calls 50]

``--device cpu``: the same calls on CPU tensors over a one-rank gloo group, float32, the kernels UNIEP_KERNELS says
(the reference on CPU either way): no GPU number, but the Python around the kernels is the same, so with a small
``--hidden``/``--inter`` (the kernels' work negligible, E and K kept) it shows what the layer adds on the host
(``--profile PROVIDER``: cProfile of its calls, the top frames by own and by cumulative time; ``--trace PROVIDER``:
torch.profiler's kernel launches a call and ops by own CPU time). On CPU the reference's
grouped GEMM loops over the experts, so the kernels still take most of the time there; no sync counts.

    python benchmarks/probes/ep_host_probe.py --device cpu --hidden 64 --inter 32 --tokens 512 --calls 200 \
        --profile ep_layer
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _synchronize():
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_times(fn, leaves, grad, calls: int, warmup: int = 5):
    """(median forward µs, median backward µs) of out = fn(*leaves); out.backward(grad), host time only."""
    forward, backward = [], []
    for i in range(warmup + calls):
        inputs = [t.detach().requires_grad_() for t in leaves]
        _synchronize()
        t0 = time.perf_counter()
        out = fn(*inputs)
        t1 = time.perf_counter()
        _synchronize()
        t2 = time.perf_counter()
        out.backward(grad)
        t3 = time.perf_counter()
        _synchronize()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t3 - t2)
    return [round(sorted(t)[len(t) // 2] * 1e6, 1) for t in (forward, backward)]


def sync_calls(fn, leaves, grad):
    """[forward, backward]: the host synchronizations of one call each way: the calls torch's sync debug mode flags, and
    torch.cuda.Event.synchronize() on an event the GPU has not reached (which the debug mode does not see), as
    tests/test_ep_single_rank.py counts them."""
    inputs = [t.detach().requires_grad_() for t in leaves]
    box = {}
    counts = []
    event_synchronize = torch.cuda.Event.synchronize
    for step in (lambda: box.setdefault("out", fn(*inputs)), lambda: box["out"].backward(grad)):
        torch.cuda.synchronize()
        waits = []

        def counted(event):
            if not event.query():
                waits.append(1)
            return event_synchronize(event)
        torch.cuda.Event.synchronize = counted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
                torch.cuda.Event.synchronize = event_synchronize
        counts.append(len(waits) + sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    return counts


def profile_calls(fn, leaves, grad, calls: int, top: int = 30) -> str:
    """cProfile of ``calls`` forward and backward calls, each profiled alone with the GPU synchronized outside the
    profiled region (so a frame's time is host work or a wait the call itself makes, not a wait for earlier calls):
    the top frames by own time, then by cumulative time."""
    inputs = [[t.detach().requires_grad_() for t in leaves] for _ in range(calls)]
    profiler = cProfile.Profile()
    for leaf_inputs in inputs:
        _synchronize()
        profiler.enable()
        out = fn(*leaf_inputs)
        profiler.disable()
        _synchronize()
        profiler.enable()
        out.backward(grad)
        profiler.disable()
    _synchronize()
    text = io.StringIO()
    for key in ("tottime", "cumtime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def trace_calls(fn, leaves, grad, calls: int = 3, top: int = 25, stacks: str = "") -> str:
    """torch.profiler (CPU and CUDA activity) of ``calls`` forward and backward calls, each traced alone with the GPU
    synchronized outside: per call, the kernel launches (the CUDA runtime's and driver's launch calls: Triton's,
    QuACK's and torch's kernels alike), and the ops and launch calls by their own CPU time, forward then backward.
    Unlike cProfile it sees inside the custom ops' C++ dispatch. With ``stacks`` (comma-separated path fragments, e.g.
    "uniep_dynamo,triton"): Python's frames too (the profiler's Python tracer, which adds its own cost to every
    call), the functions whose path holds a fragment by inclusive time, and where the allocator's and synchronizing
    CUDA calls come from."""
    from torch.profiler import ProfilerActivity, profile

    text = io.StringIO()
    for phase in ("forward", "backward"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(stacks)) as prof:
            for _ in range(calls):
                inputs = [t.detach().requires_grad_() for t in leaves]
                if phase == "backward":
                    out = fn(*inputs)
                _synchronize()
                with torch.profiler.record_function(f"probe_{phase}"):
                    if phase == "forward":
                        fn(*inputs)
                    else:
                        out.backward(grad)
                _synchronize()
                out = None  # this call's graph and buffers freed before the next call, as in host_times
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                             "cudaLaunchKernelExC"))
        phase_us = sum(e.cpu_time_total for e in events if e.key == f"probe_{phase}") / calls
        print(f"{phase}: {phase_us:.0f} µs of host time a call (profiled), {launches / calls:.1f} kernel launches a "
              "call", file=text)
        print(events.table(sort_by="self_cpu_time_total", row_limit=top), file=text)
        if stacks:
            for e in prof.key_averages(group_by_stack_n=12):
                if e.key in ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaEventSynchronize"):
                    print(f"{e.key} x{e.count / calls:.1f} a call, {e.cpu_time_total / calls:.0f} µs a call, from:",
                          file=text)
                    print("    " + "\n    ".join(e.stack), file=text)
            with tempfile.TemporaryDirectory() as tmp:  # the Python tracer's frames are in the trace only
                prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                with open(os.path.join(tmp, "trace.json")) as f:
                    trace = json.load(f)["traceEvents"]
            python = [ev for ev in trace if ev.get("cat") == "python_function" and "dur" in ev]
            frames = {}
            for ev in python:
                if any(m in ev["name"] for m in stacks.split(",")):
                    total, count = frames.get(ev["name"], (0.0, 0))
                    frames[ev["name"]] = (total + ev["dur"], count + 1)
            for ev in trace:  # the Python frames around each allocator call, innermost first
                if ev.get("name") in ("cudaMalloc", "cudaFree", "cudaHostAlloc") and "dur" in ev:
                    around = [f for f in python if f.get("tid") == ev.get("tid") and f["ts"] <= ev["ts"]
                              and f["ts"] + f["dur"] >= ev["ts"] + ev["dur"]]
                    around.sort(key=lambda f: f["dur"])
                    print(f"{ev['name']} {ev['dur']:.0f} µs in: " + " < ".join(f["name"] for f in around[:8]),
                          file=text)
            print(f"{'µs a call (incl.)':>18} {'calls a call':>12}  Python function", file=text)
            for name, (total, count) in sorted(frames.items(), key=lambda kv: -kv[1][0])[:3 * top]:
                print(f"{total / calls:18.0f} {count / calls:12.1f}  {name}", file=text)
    return text.getvalue()


def forward_no_grad(fn, leaves, calls: int, warmup: int = 5):
    """Median host µs of the forward without autograd: what a compiled graph's call of the op costs (AOTAutograd
    runs the forward graph below autograd), against host_times' eager call through the op's autograd formula."""
    times = []
    with torch.no_grad():
        for i in range(warmup + calls):
            _synchronize()
            t0 = time.perf_counter()
            fn(*leaves)
            t1 = time.perf_counter()
            if i >= warmup:
                times.append(t1 - t0)
    _synchronize()
    return round(sorted(times)[len(times) // 2] * 1e6, 1)


def main():
    import bench_moe_layer as bench

    import uniep_dynamo  # noqa: F401  (registers the ops)
    from uniep_dynamo.ep import MULTICAST_OFF
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hidden", type=int, help="H instead of the shape's (small on CPU: the kernels' work)")
    parser.add_argument("--inter", type=int, help="I instead of the shape's")
    parser.add_argument("--profile", default="", help="providers (comma-separated) whose calls cProfile profiles")
    parser.add_argument("--trace", default="", help="providers (comma-separated) whose calls torch.profiler traces")
    parser.add_argument("--trace-stacks", default="", help="with --trace: Python frames whose path holds one of "
                        "these comma-separated fragments, by inclusive time (e.g. uniep_dynamo,triton)")
    parser.add_argument("--providers", default="", help="comma-separated; default: all")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_host_probe.json"))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dev, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if cuda:
        torch.cuda.set_device(dev)
    H, I, E, K = bench.SHAPES[args.shape]
    H, I = args.hidden or H, args.inter or I
    x, ids, w, grad = bench.make_inputs(H, I, E, K, args.tokens, dtype, dev.type)
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype).encode()

    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    store_dir = tempfile.mkdtemp()
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    if cuda:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group_name = dist.group.WORLD.group_name
    providers = {
        "moe_experts": lambda h, tw, a, b: torch.ops.uniep.moe_experts(h, ids, tw, a, b, None, None, [], spec)[0],
        "ep_layer": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec, group_name, 1,
                                                                 False, "")[0],
        "ep_layer_overlap": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec,
                                                                         group_name, 1, True, "")[0],
        "ep_layer_device_plan": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec,
                                                                             group_name, 1, False, "", 1)[0],
        "ep_layer_device_pipeline": lambda h, tw, a, b: torch.ops.uniep.ep_layer(h, ids, tw, a, b, None, None, spec,
                                                                                 group_name, 1, True, "", 1)[0],
    }
    if args.providers:
        providers = {n: providers[n] for n in args.providers.split(",")}
    results = {}
    try:
        for name, fn in providers.items():
            leaves = (x, w, w_up, w_down)
            forward_us, backward_us = host_times(fn, leaves, grad, args.calls)
            no_grad_us = forward_no_grad(fn, leaves, args.calls)
            forward_syncs, backward_syncs = sync_calls(fn, leaves, grad) if cuda else (None, None)
            results[name] = {"forward_us": forward_us, "backward_us": backward_us, "forward_no_grad_us": no_grad_us,
                             "forward_syncs": forward_syncs, "backward_syncs": backward_syncs}
            syncs = [f" ({n} sync)" if n is not None else "" for n in (forward_syncs, backward_syncs)]
            print(f"{name:18s} forward {forward_us:9.1f} µs{syncs[0]}   backward {backward_us:9.1f} µs{syncs[1]}   "
                  f"forward without autograd {no_grad_us:9.1f} µs", flush=True)
            if name in args.profile.split(","):
                print(profile_calls(fn, leaves, grad, args.calls), flush=True)
            if name in args.trace.split(","):
                print(trace_calls(fn, leaves, grad, stacks=args.trace_stacks), flush=True)
    finally:
        dist.destroy_process_group()
    report = {"shape": args.shape, "hidden": H, "inter": I, "tokens": args.tokens, "calls": args.calls,
              "device": args.device, "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "kernels": os.environ.get("UNIEP_KERNELS", "auto"), "torch": torch.__version__, "host": results}
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
