"""Where the GPU waits for the host, in a chrome trace of host and GPU activity (``bench_ep.py --profile P --trace-dir
D`` writes them): each idle gap on the GPU longer than ``--min-us``, the kernels around it, the host time between
their two launches, and the host events of at least ``--min-event-us`` between those launches (when the gap is the
host's, they say what the host was doing; when the host time is much longer than the gap, the GPU had work queued).

    python benchmarks/probes/trace_gaps.py TRACE.json.gz [--min-us 80] [--min-event-us 15]
"""
from __future__ import annotations

import argparse
import gzip
import json

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH = ("cuda_runtime", "cuda_driver")
HOST = ("cpu_op", "user_annotation", "python_function")


def gaps(events, min_us: float):
    """(gap µs, kernel before, kernel after, launch before, launch after) for each GPU idle gap over ``min_us``; a
    launch is None where the trace has no host call with the kernel's correlation id."""
    work = sorted((e for e in events if e.get("cat") in GPU), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in LAUNCH and "args" in e}
    reach, last = None, None
    for k in work:
        if reach is not None and k["ts"] - reach > min_us:
            yield (k["ts"] - reach, last, k, launches.get(last["args"].get("correlation")),
                   launches.get(k["args"].get("correlation")))
        if reach is None or k["ts"] + k["dur"] > reach:
            reach, last = k["ts"] + k["dur"], k


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--min-us", type=float, default=80.0)
    parser.add_argument("--min-event-us", type=float, default=15.0)
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    host = sorted((e for e in events if e.get("cat") in HOST and e.get("ph") == "X"), key=lambda e: e["ts"])
    for us, before, after, a, b in gaps(events, args.min_us):
        span = f"{b['ts'] - a['ts']:.0f}" if a and b else "?"
        print(f"\ngap {us:.0f} µs after {before['name'][:60]} before {after['name'][:60]} (host between the launches: "
              f"{span} µs)")
        if a and b:
            for e in host:
                if a["ts"] - 5 <= e["ts"] <= b["ts"] and e["dur"] >= args.min_event_us:
                    print(f"  {e['ts'] - a['ts']:8.0f} +{e['dur']:7.0f}  {e['name'][:110]}")


if __name__ == "__main__":
    main()
