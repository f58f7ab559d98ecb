"""Is the back-to-back step the GPU's own time, or does the GPU wait between kernels? Steps issued while the GPU is held.

bench_moe_layer.py's back-to-back step (uniep's Qwen3-30B-A3B layer: 3.87-4.13 ms on H200s) is longer than one
profiled step's kernels (3.63 ms). Either the GPU idles between kernels (the host falls behind somewhere in the
step, or launches leave gaps) or the kernels run slower under sustained load. Here the GPU is first held by a sleep
kernel while the host issues ``--steps`` steps; the steps then run from a full queue, so no kernel waits for the
host. Per provider, ms a step:

- ``synchronized``: bench_moe_layer.py's median of 20 synchronized steps;
- ``back_to_back``: bench_moe_layer.py's loop (one untimed step, then ``--steps`` steps with no synchronization);
- ``queued``: the same steps issued during the sleep (``host_done_first`` says whether the host finished issuing
  before the sleep ended; if not, the queue filled or the host was slow and the number is not a queued one);
- ``kernels_single``: the kernels' summed durations in one profiled step started on an idle GPU;
- ``queued_busy`` / ``queued_idle``: under the profiler, the queued steps' GPU time covered by kernels (union of
  their intervals) and not covered, a step, over the span from the first kernel to the last.

Also ``b2b_long`` (4 x ``--steps`` back to back, the host's issue time a step beside it) and ``b2b_long_nogc``
(Python's collector off). The same for an 8192^3 bf16 matmul: its synchronized median (bench_moe_layer.py's peak),
queued (50), and 100 back to back.
Writes $OUT/queued_step_probe.json.

    python benchmarks/probes/queued_step_probe.py --shapes qwen3-30b-a3b,olmoe --providers uniep,sonicmoe
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import (SHAPES, bitwise_equal, hf_experts, make_inputs, providers, step,  # noqa: E402
                             time_cuda_back_to_back, to_host)
from uniep_dynamo.tuner import time_cuda  # noqa: E402


def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def gpu_busy(events, leave_out=()) -> tuple:
    """(µs covered by GPU work, µs from its first start to its last end) in a chrome trace's events: the union of
    the kernels', copies' and memsets' intervals, those whose names hold a word of ``leave_out`` left out."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                   and not any(word in e.get("name", "") for word in leave_out))
    covered, reach = 0.0, None
    for a, b in spans:
        if reach is None or a > reach:
            covered, reach = covered + b - a, b
        elif b > reach:
            covered, reach = covered + b - reach, b
    return covered, (reach - spans[0][0]) if spans else 0.0


def queued(run, steps: int, cycles_per_ms: float, host_ms_guess: float, trace: str | None = None):
    """(ms a step, host finished issuing before the sleep ended, busy ms a step, idle ms a step) for ``steps`` calls
    of ``run`` issued while a sleep kernel holds the GPU; busy / idle only under ``trace`` (a chrome trace path)."""
    sleep_ms = 50.0 + 2.0 * steps * host_ms_guess
    torch.cuda.synchronize()
    slept, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    prof = None
    if trace:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    slept.record()
    torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    if prof is not None:
        prof.__exit__(None, None, None)
    slept_ms = slept.elapsed_time(start)
    ms = start.elapsed_time(end) / steps
    busy = idle = None
    if prof is not None:
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        covered, span = gpu_busy(events, leave_out=("sleep", "spin"))  # (torch.cuda._sleep's kernel)
        busy, idle = covered / 1e3 / steps, (span - covered) / 1e3 / steps
    return ms, host_ms < slept_ms, busy, idle, host_ms / steps


def back_to_back_host(run, steps: int, collect: bool = True):
    """(ms a step on the GPU, ms a step on the host) for ``steps`` steps issued back to back as bench_moe_layer.py
    issues them; ``collect=False`` with Python's garbage collector off during the steps."""
    import gc

    torch.cuda.synchronize()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if not collect:
        gc.collect()
        gc.disable()
    try:
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        host = (time.perf_counter() - t0) * 1e3 / steps
        end.record()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return start.elapsed_time(end) / steps, host


def host_trace(run, steps: int, path: str) -> dict:
    """A chrome trace (host and GPU) of ``steps`` steps back to back, written to ``path``, and its summary: per step the
    host's span, the time in CUDA launch calls and their count, the GPU's busy and idle time, and the host events
    with the most total time (nested events count in each of their parents too)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    run()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e["name"]]
    covered, span = gpu_busy(events)
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime",
                                                  "cuda_driver")]
    totals: dict = {}
    for e in host:
        name = e["name"][:90]
        t, n = totals.get(name, (0.0, 0))
        totals[name] = (t + e["dur"], n + 1)
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:40]
    span_host = (max(e["ts"] + e["dur"] for e in host) - min(e["ts"] for e in host)) if host else 0.0
    return {"host_span_ms": round(span_host / 1e3 / steps, 3),
            "launch_calls": round(len(launches) / steps, 1),
            "launch_ms": round(sum(e["dur"] for e in launches) / 1e3 / steps, 3),
            "gpu_busy_ms": round(covered / 1e3 / steps, 3),
            "gpu_span_ms": round(span / 1e3 / steps, 3),
            "top_host_events_ms_per_step": [(name, round(t / 1e3 / steps, 3), round(n / steps, 1))
                                            for name, (t, n) in top]}


def kernels_single(run) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--providers", default="uniep,sonicmoe,sort_grouped_mm_inductor")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-matmul", dest="matmul", action="store_false", help="leave out the 8192^3 matmul")
    parser.add_argument("--sonicmoe-default-configs", action="store_true")
    parser.add_argument("--host-trace", default="", help="providers whose back-to-back steps to trace, host and GPU")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "queued_step_probe.json"))
    args = parser.parse_args()
    cpm = _cycles_per_ms()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps, "rows": []}
    if args.matmul:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        sync_ms = time_cuda(lambda: a @ a, 50, 25)
        q_ms, first, _, _, _ = queued(lambda: a @ a, 50, cpm, 0.05)
        flop = 2 * 8192**3
        long_ms, _ = back_to_back_host(lambda: a @ a, 100)
        result["matmul"] = {"sync_tflops": round(flop / sync_ms / 1e9, 1), "queued_tflops": round(flop / q_ms / 1e9, 1),
                            "back_to_back_100_tflops": round(flop / long_ms / 1e9, 1), "host_done_first": first}
        print(json.dumps(result["matmul"]), flush=True)
    tmp = tempfile.mkdtemp()
    for shape in args.shapes.split(","):
        name, _, tokens = shape.partition("@")
        H, I, E, K = SHAPES[name]
        T = int(tokens or args.tokens)
        experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
        x, ids, w, grad_out = make_inputs(H, I, E, K, T, torch.bfloat16, "cuda")
        table = providers(experts, not args.sonicmoe_default_configs)
        first_results = None
        for pname in args.providers.split(","):
            if pname not in table:
                print(f"# {pname}: not available", flush=True)
                continue
            run = step(table[pname], experts, x, ids, w, grad_out)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            row = {"shape": shape, "tokens": T, "provider": pname}
            results = to_host(run())
            if first_results is None:
                first_results = (pname, results)
            else:  # the bits against the first provider's
                row["bitwise_vs_" + first_results[0]] = all(bitwise_equal(p, q) for p, q in zip(results, first_results[1]))
            row["synchronized"] = round(time_cuda(run, 20, 3), 3)  # bench_moe_layer.py's median of synchronized steps
            row["back_to_back"] = round(time_cuda_back_to_back(run, args.steps * 2), 3)
            ms, first, _, _, host = queued(run, args.steps, cpm, 5.0)
            row.update(queued=round(ms, 3), host_done_first=first, host_issue_ms=round(host, 3))
            row["kernels_single"] = round(kernels_single(run), 3)
            _, _, busy, idle, _ = queued(run, args.steps, cpm, 8.0, trace=os.path.join(tmp, "trace.json"))
            row.update(queued_busy=round(busy, 3), queued_idle=round(idle, 3))
            row["back_to_back_again"] = round(time_cuda_back_to_back(run, args.steps * 2), 3)
            gpu_ms, host_ms = back_to_back_host(run, args.steps * 4)
            row.update(b2b_long=round(gpu_ms, 3), b2b_long_host=round(host_ms, 3))
            gpu_ms, host_ms = back_to_back_host(run, args.steps * 4, collect=False)
            row.update(b2b_long_nogc=round(gpu_ms, 3), b2b_long_nogc_host=round(host_ms, 3))
            if pname in args.host_trace.split(","):
                path = os.path.join(os.environ.get("OUT", "."), f"trace-{name}-{T}-{pname}.json")
                row["host_trace"] = host_trace(run, 4, path)
                os.system(f"gzip -f {path}")
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            del run
        del experts, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
