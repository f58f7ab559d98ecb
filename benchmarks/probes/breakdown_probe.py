"""Where does one MoE experts layer (forward + backward) lose against the GPU's matmul peak? (issue 39, step 2)

For each shape and provider, one step's GPU kernels in launch order with their durations (torch.profiler), their sum
against the step's wall time (the rest is the GPU waiting for the host), and for uniep each piece labelled by what it
computes (up, down, grad_act, ... GEMMs and the glue passes: gather, activation, combine, routing-weight gradient),
timed by CUDA events around the call, with its TFLOP/s (GEMMs) or GB/s (glue, bytes read + written at least once).

Beside them the same six GEMMs by cuBLAS as one batched matmul over equal-sized experts (``torch.bmm``, rows T*K/E
each): the GEMMs with no routing, no unevenness and no glue. Their sum is the floor of a layer built of these GEMMs;
the matmul peak (an 8192^3 bf16 matmul) is the floor of any layer.

    python benchmarks/probes/breakdown_probe.py --shapes qwen3-30b-a3b,mixtral --providers uniep,sonicmoe,inductor

Writes $OUT/breakdown_probe.json.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import (SHAPES, hf_experts, make_inputs, sonicmoe_experts, step,  # noqa: E402
                             time_cuda_back_to_back)

from uniep_dynamo.tuner import time_cuda  # noqa: E402


def gemm_shapes(T, H, I, E, K):
    """(name, batch, m, n, k) of the six GEMMs over equal experts (rows R = T*K/E each)."""
    R = T * K // E
    return [("up", E, R, 2 * I, H), ("down", E, R, H, I), ("grad_act", E, R, I, H), ("grad_input", E, R, H, 2 * I),
            ("wgrad_up", E, H, 2 * I, R), ("wgrad_down", E, I, H, R)]


def bmm_floor(T, H, I, E, K, iters):
    out = {}
    for name, b, m, n, k in gemm_shapes(T, H, I, E, K):
        a = torch.randn(b, m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(b, k, n, device="cuda", dtype=torch.bfloat16)
        ms = time_cuda(lambda: torch.bmm(a, w), iters, 5)
        out[name] = {"ms": round(ms, 4), "tflops": round(2 * b * m * n * k / ms / 1e9, 1)}
        del a, w
    return out


def call_label(signature, label_of, args, kwargs):
    """label_of(the call's arguments by name, defaults filled in): positional and keyword calls get the same label."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return label_of(bound.arguments)


class Timeline:
    """CUDA events around uniep's kernel entry points, nested: exclusive time per label."""

    def __init__(self):
        self.records = []  # (label, depth, start event, end event)
        self.depth = 0

    def wrap(self, module, name, label_of):
        original = getattr(module, name)
        signature = inspect.signature(original)

        def wrapped(*args, **kwargs):
            label = call_label(signature, label_of, args, kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            index = len(self.records)
            self.records.append(None)
            self.depth += 1
            start.record()
            try:
                return original(*args, **kwargs)
            finally:
                end.record()
                self.depth -= 1
                self.records[index] = (label, self.depth, start, end)

        setattr(module, name, wrapped)
        return module, name, original

    def summary(self):
        torch.cuda.synchronize()
        rows = []
        for i, (label, depth, start, end) in enumerate(self.records):
            total = start.elapsed_time(end)
            # subtract direct children (records after i at depth+1 until the next record at <= depth)
            child = 0.0
            for label2, depth2, s2, e2 in self.records[i + 1:]:
                if depth2 <= depth:
                    break
                if depth2 == depth + 1:
                    child += s2.elapsed_time(e2)
            rows.append((label, total - child))
        return rows


def gemm_label(arguments):
    from uniep_dynamo.kernels.config import GEMMS

    for g in GEMMS:
        if getattr(arguments["layer"].config, g) is arguments["cfg"]:
            return g
    return "gemm?"


def piece_labels():
    """(module, entry point, label of its call's arguments by name) for each of uniep's pieces the probe times."""
    from uniep_dynamo.kernels import megakernel, triton_routing

    return [
        (megakernel, "rows_gemm", gemm_label),
        (megakernel, "weight_grad", gemm_label),
        (megakernel, "_act_forward", lambda a: "act_forward"),
        (megakernel, "act_backward", lambda a: "act_backward"),
        (triton_routing, "routing_plan", lambda a: "routing_plan"),
        (triton_routing, "gather_rows", lambda a: "gather_rows_scaled" if a["weights"] is not None else "gather_rows"),
        (triton_routing, "combine", lambda a: "combine" if a["weights"] is not None else "combine_grad"),
        (triton_routing, "routing_weight_grad", lambda a: "routing_weight_grad"),
    ]


@contextlib.contextmanager
def labelled(timeline):
    patches = [timeline.wrap(module, name, label_of) for module, name, label_of in piece_labels()]
    try:
        yield
    finally:
        for module, name, original in patches:
            setattr(module, name, original)


def glue_bytes(label, T, H, I, E, K):
    """Bytes a glue pass reads and writes at least once (bf16)."""
    S = T * K
    b = 2
    return {"gather_rows": S * H * b + T * H * b, "gather_rows_scaled": S * H * b + T * H * b,
            "act_forward": S * 3 * I * b, "act_backward": S * (I + 2 * I + 2 * I + I) * b,
            "combine": S * H * b + T * H * b, "combine_grad": S * H * b + T * H * b,
            "routing_weight_grad": S * H * b + T * H * b}.get(label)


def variant_config(name, T, H, I, E, K):
    import dataclasses

    from uniep_dynamo.kernels.config import GEMMS, heuristic_config

    base = heuristic_config(T * K, E, H, I)
    if name == "up_triton":
        return dataclasses.replace(base, up=dataclasses.replace(base.up, grouped_mm=False))
    if name == "up_triton_gather":
        return dataclasses.replace(base, up=dataclasses.replace(base.up, grouped_mm=False), fuse_gather=True)
    if name == "all_triton":
        return dataclasses.replace(base, **{g: dataclasses.replace(getattr(base, g), grouped_mm=False) for g in GEMMS})
    if name == "tma":
        return dataclasses.replace(base, tma=not base.tma)
    raise ValueError(f"unknown variant {name}")


def labelled_pieces(run, T, H, I, E, K, floor):
    """uniep's step with each piece labelled: [(label, ms, TF/s or GB/s)], printed."""
    for _ in range(2):  # the first labelled run after patching may allocate more
        timeline = Timeline()
        with labelled(timeline):
            run()
        pieces = timeline.summary()
    shapes = {g: (b, m, n, k) for g, b, m, n, k in gemm_shapes(T, H, I, E, K)}
    out = []
    print("   labelled (CUDA events, exclusive):")
    for label, pms in pieces:
        cell = {"label": label, "ms": round(pms, 4)}
        if label in shapes:
            b, m, n, k = shapes[label]
            cell["tflops"] = round(2 * b * m * n * k / pms / 1e9, 1)
            cell["bmm_ms"] = floor[label]["ms"]
            extra = f"{cell['tflops']:6.1f} TF/s (bmm {floor[label]['ms']:.4f} ms)"
        elif glue_bytes(label, T, H, I, E, K):
            cell["gbps"] = round(glue_bytes(label, T, H, I, E, K) / pms / 1e6, 1)
            extra = f"{cell['gbps']:7.1f} GB/s"
        else:
            extra = ""
        out.append(cell)
        print(f"   {pms:8.4f} ms  {label:22s} {extra}")
    print(f"   sum of labelled pieces {sum(p[1] for p in pieces):.4f} ms", flush=True)
    return out


def sync_calls(run):
    """The synchronizing CUDA calls one ``run()`` makes (torch's sync debug mode), each with the innermost frames
    outside torch that made it."""
    import traceback
    import warnings

    found = []

    def note(message, *args, **kwargs):
        frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                  if "/torch/" not in f.filename][-4:]
        found.append((str(message)[:120], frames))

    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on the way out
            warnings.simplefilter("always")
            warnings.showwarning = note
            run()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    return found


def busy_back_to_back(run, steps: int = 5):
    """(GPU busy ms, wall ms) per step over ``steps`` steps issued back to back under the profiler: busy is the
    union of the kernels' intervals, wall from the first kernel's start to the last one's end."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    wall = spans[-1][1] - spans[0][0] if spans else 0.0
    return busy / 1e3 / steps, wall / 1e3 / steps


def kernel_list(run):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    rows = [(e.name[:90], round(e.time_range.elapsed_us() / 1e3, 4)) for e in kernels]
    return rows, start.elapsed_time(end)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral")
    parser.add_argument("--providers", default="uniep,sonicmoe,inductor")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", default="",
                        help="uniep again under these configs, comma separated: up_triton (the up projection by the "
                             "Triton GEMM with its activation epilogue), up_triton_gather (and every gather fused into "
                             "the GEMMs), all_triton (every GEMM by Triton), tma (tensor-descriptor tiles)")
    parser.add_argument("--busy", action="store_true",
                        help="5 steps back to back under the profiler: the GPU's busy time (union of kernel "
                             "intervals) against the wall time, a step")
    parser.add_argument("--sync-check", action="store_true",
                        help="one more step of each provider under torch.cuda.set_sync_debug_mode('warn'): every "
                             "synchronizing call it makes, with where it was made")
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel profiler listing")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "breakdown_probe.json"))
    args = parser.parse_args()
    import uniep_dynamo  # noqa: F401

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / time_cuda(lambda: a @ a, 50, 25) / 1e9
    del a
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "matmul_peak_tflops": round(peak, 1),
              "shapes": {}}
    print(f"# {result['gpu']}: bf16 8192^3 matmul {peak:.1f} TFLOP/s", flush=True)
    for spec in args.shapes.split(","):
        name, _, tokens = spec.partition("@")
        T = int(tokens or args.tokens)
        H, I, E, K = SHAPES[name]
        torch._dynamo.reset()
        flops = 3 * 2 * T * K * 3 * H * I
        shape = {"T": T, "ideal_ms_at_peak": round(flops / peak / 1e9, 4)}
        floor = bmm_floor(T, H, I, E, K, args.iters)
        shape["bmm_equal_experts"] = floor
        shape["bmm_sum_ms"] = round(sum(v["ms"] for v in floor.values()), 4)
        print(f"\n## {spec}: ideal at peak {shape['ideal_ms_at_peak']} ms; six GEMMs as cuBLAS bmm over equal "
              f"experts {shape['bmm_sum_ms']} ms", flush=True)
        for g, v in floor.items():
            print(f"   bmm {g:12s} {v['ms']:8.4f} ms {v['tflops']:6.1f} TF/s", flush=True)
        experts = hf_experts(H, I, E, K, torch.bfloat16, "cuda")
        x, ids, w, grad_out = make_inputs(H, I, E, K, T, torch.bfloat16, "cuda")
        fns = {}
        for p in args.providers.split(","):
            try:
                if p == "uniep":
                    c = torch.compile(experts, backend="uniep")
                    fns[p] = lambda x, ids, w, c=c: c(x, ids, w)
                elif p == "inductor":
                    c = torch.compile(experts)
                    fns[p] = lambda x, ids, w, c=c: c(x, ids, w)
                elif p == "sonicmoe":
                    fns[p] = sonicmoe_experts(experts, "default")
                elif p == "sonicmoe_small":  # its GEMMs tuned per shape over bench_moe_layer.SONICMOE_SMALL_SPACE
                    fns[p] = sonicmoe_experts(experts, "small")
            except Exception as exc:  # noqa: BLE001
                print(f"# {p} unavailable: {exc!r}", flush=True)
        for p, fn in fns.items():
            try:
                run = step(fn, experts, x, ids, w, grad_out)
                run()
                ms = time_cuda(run, args.iters, 3)
                b2b = time_cuda_back_to_back(run, args.iters)
                kernels, wall = kernel_list(run) if not args.no_kernels else ([], float("nan"))
                total = sum(k[1] for k in kernels)
                entry = {"ms": round(ms, 4), "back_to_back_ms": round(b2b, 4), "tflops": round(flops / ms / 1e9, 1), "pct_peak": round(100 * flops / ms / 1e9 / peak, 1),
                         "profiled_wall_ms": round(wall, 4), "kernel_sum_ms": round(total, 4), "kernels": kernels}
                print(f"\n### {spec} {p}: {ms:.3f} ms, back to back {b2b:.3f} ms ({entry['tflops']} TF/s, {entry['pct_peak']}% of peak); "
                      f"kernels {total:.3f} ms of {wall:.3f} ms profiled", flush=True)
                for kname, kms in kernels:
                    print(f"   {kms:8.4f}  {kname}")
                if hasattr(fn, "tuned"):  # the QuACK configs a tuned SonicMoE chose, GEMM by GEMM
                    entry["tuned_configs"] = [[name, str(key[:3]), str(cfg)] for name, chosen in fn.tuned().items()
                                              for key, cfg in chosen.items()]
                    for name, key, cfg in entry["tuned_configs"]:
                        print(f"   tuned {name} {key}: {cfg}", flush=True)
                if args.busy:
                    busy, wall = busy_back_to_back(run)
                    entry["back_to_back_busy_ms"], entry["back_to_back_wall_ms"] = round(busy, 4), round(wall, 4)
                    print(f"   back to back under the profiler: GPU busy {busy:.3f} ms of {wall:.3f} ms a step "
                          f"({100 * busy / wall:.1f}%)", flush=True)
                if args.sync_check:
                    entry["sync_calls"] = sync_calls(run)
                    print(f"   synchronizing calls in one step: {len(entry['sync_calls'])}")
                    for message, frames in entry["sync_calls"]:
                        print(f"     {message} at {' <- '.join(reversed(frames))}")
                if p == "uniep":
                    entry["pieces"] = labelled_pieces(run, T, H, I, E, K, floor)
                    for v in filter(None, args.variants.split(",")):
                        from uniep_dynamo.kernels.config import use_config

                        cfg = variant_config(v, T, H, I, E, K)

                        def run_v(run=run, cfg=cfg):
                            with use_config(cfg):
                                return run()

                        vms = time_cuda(run_v, args.iters, 3)
                        vb2b = time_cuda_back_to_back(run_v, args.iters)
                        same = all(torch.equal(a, b) for a, b in zip(run_v(), run()))
                        print(f"\n### {spec} uniep variant {v}: {vms:.3f} ms, back to back {vb2b:.3f} (default {ms:.3f}, {b2b:.3f}); bitwise equal to the "
                              f"default: {same}", flush=True)
                        entry[f"variant_{v}"] = {"ms": round(vms, 4), "back_to_back_ms": round(vb2b, 4), "bitwise_equal_default": same,
                                                 "pieces": labelled_pieces(run_v, T, H, I, E, K, floor)}
                shape[p] = entry
            except Exception as exc:  # noqa: BLE001
                shape[p] = f"ERR {exc!r}"[:400]
                print(f"# {spec} {p}: {shape[p]}", flush=True)
            for prm in experts.parameters():
                prm.grad = None
            torch.cuda.empty_cache()
        result["shapes"][spec] = shape
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
