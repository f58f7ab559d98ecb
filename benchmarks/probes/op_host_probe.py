"""Host time of the experts op's forward and its pieces, on one GPU (issue 3: in a synchronized step the GPU waits
for the host until the op's first launch). Median µs a call over --calls calls, the GPU synchronized between calls
(outside the timed region), Qwen3-30B-A3B's shape by default:

  op               torch.ops.uniep.moe_experts (the dispatcher, the custom op's checks, the implementation)
  op_inference     the op marked as an inference graph marks it: at most op_graphs.MAX_SLOTS slots replay its CUDA
                   graph (kernels/op_graphs.py)
  block_inference  torch.ops.uniep.moe_block: the router op (below; its plan only past op_graphs.MAX_SLOTS slots) and
                   the marked experts op in one op, as an inference graph fuses them (backend._fuse_block); calls of
                   at most MAX_SLOTS slots replay one CUDA graph
  impl             the op's Python implementation called directly
  experts_forward  megakernel.experts_forward
  use_megakernel   the checks that pick the fused kernels
  layer            megakernel.Layer (weight views, the config lookup)
  current_config   the config lookup alone
  routing_plan     the routing plan's buffers and three launches
  up_gemm          the up projection (torch._grouped_mm and the activation pass), down_gemm, combine
  to_first_launch  from the op call to its first Triton launch
  router           torch.ops.uniep.moe_router (Qwen3-MoE's softmax top-k router, with the routing plan, as the
                   lowering asks for it), router_impl its implementation called directly, router_forward the
                   fused kernels' host function

    python benchmarks/probes/op_host_probe.py [--shape qwen3-30b-a3b] [--calls 200]

``--cprofile N`` also prints the Python functions under N calls of the experts op and N of the router op (cProfile;
its overhead inflates every number, the ranking is what it is for), by own and by cumulative time, and
``--back-to-back`` times each piece over --calls calls with no synchronization between them (µs a call: the host's
rate while the GPU keeps up).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def median_us(fn, calls):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    times.sort()
    return round(times[len(times) // 2] * 1e6, 1)


def back_to_back_us(fn, calls):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 1)


def python_profile(fn, name, calls):
    """Print the Python functions under ``calls`` calls of ``fn`` by own and by cumulative time (µs a call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = [(f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", v[1] / calls, v[2] * 1e6 / calls, v[3] * 1e6 / calls)
            for k, v in pstats.Stats(prof).stats.items()]
    for title, column in (("own", 2), ("cumulative", 3)):
        print(f"-- {name}: Python functions by {title} time (calls a call, own µs, cumulative µs a call; cProfile)")
        for row in sorted(rows, key=lambda r: -r[column])[:40]:
            print(f"   {row[2]:8.1f} {row[3]:8.1f} {row[1]:5.1f}  {row[0]}")


def main():
    import bench_moe_layer as bench

    from uniep_dynamo import ops
    from uniep_dynamo.kernels import config as config_mod
    from uniep_dynamo.kernels import launch as launch_mod
    from uniep_dynamo.kernels import megakernel, triton_routing
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_gemm import GLU_FWD, STORE
    from uniep_dynamo.kernels import triton_router
    from uniep_dynamo.spec import ExpertsSpec, RouterSpec, decode_router_spec, decode_spec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cprofile", type=int, default=0)
    parser.add_argument("--back-to-back", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "op_host_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    H, I, E, K = bench.SHAPES[args.shape]
    x, ids, w, _ = bench.make_inputs(H, I, E, K, args.tokens, dtype, "cuda")
    w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    text = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype).encode()
    # the op as an inference graph marks it (backend.mark_inference): small calls replay its CUDA graph (op_graphs.py)
    text_inference = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype, inference=True).encode()
    spec = decode_spec(text)
    impl = getattr(ops.moe_experts, "_init_fn", None)
    router_weight = torch.randn(E, H, device=dev, dtype=dtype) * 0.02
    router_text = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=dtype, plan=True).encode()
    router_spec = decode_router_spec(router_text)
    router_impl = getattr(ops.moe_router, "_init_fn", None)
    from uniep_dynamo.kernels import op_graphs
    # as the backend fuses it: past the graphs' slot limit the block's router builds the plan its experts take
    block_router_text = RouterSpec("softmax_topk", E, K, renorm=True, weights_dtype=dtype,
                                   plan=ids.numel() > op_graphs.MAX_SLOTS).encode()
    layer = megakernel.Layer(x, ids, w_up, w_down, spec)
    plan = triton_routing.routing_plan(ids, E, False)
    row_order, slot_row, offsets = plan
    act = torch.empty(ids.numel(), I, dtype=dtype, device=dev)
    down_in = torch.randn(ids.numel(), I, dtype=dtype, device=dev)
    down_rows = torch.randn(ids.numel(), H, dtype=dtype, device=dev)
    xs = triton_routing.gather_rows(x, row_order, K)

    first = {}
    real_launch = launch_mod.launch

    def timed_launch(*a, **kw):
        first.setdefault("t", time.perf_counter())
        return real_launch(*a, **kw)

    def to_first_launch():
        first.clear()
        t0 = time.perf_counter()
        torch.ops.uniep.moe_experts(x, ids, w, w_up, w_down, None, None, [], text)
        return first["t"] - t0

    pieces = {
        "op": lambda: torch.ops.uniep.moe_experts(x, ids, w, w_up, w_down, None, None, [], text),
        "op_inference": lambda: torch.ops.uniep.moe_experts(x, ids, w, w_up, w_down, None, None, [], text_inference),
        "block_inference": lambda: torch.ops.uniep.moe_block(x, router_weight, None, None, block_router_text, x, w_up,
                                                             w_down, None, None, text_inference),
        "experts_forward": lambda: megakernel.experts_forward(x, ids, w, w_up, w_down, None, None, spec),
        "use_megakernel": lambda: megakernel.use_megakernel(x, ids, w_up, w_down, None, None, [], spec),
        "layer": lambda: megakernel.Layer(x, ids, w_up, w_down, spec),
        "current_config": lambda: config_mod.current_config(ids.numel(), E, H, I, False, dtype=dtype, device=dev),
        "routing_plan": lambda: triton_routing.routing_plan(ids, E, False),
        "offsets_i32": lambda: offsets.to(torch.int32),
        "up_gemm": lambda: megakernel.rows_gemm(
            layer, layer.config.up, a=xs, gather=False, row_order=row_order, b=layer.up_eff, n=I, k=H,
            epilogue=GLU_FWD, d=act, offsets=offsets, two_halves=True, col_mult=1, up_shift=I),
        "down_gemm": lambda: megakernel.rows_gemm(
            layer, layer.config.down, a=down_in, gather=False, row_order=row_order, b=layer.down_eff, n=H, k=I,
            epilogue=STORE, offsets=offsets),
        "combine": lambda: triton_routing.combine(down_rows, slot_row, w, offsets, args.tokens, K, dtype),
        "gather_rows": lambda: triton_routing.gather_rows(x, row_order, K),
        "empty": lambda: torch.empty(ids.numel(), I, dtype=dtype, device=dev),
        "router": lambda: torch.ops.uniep.moe_router(x, router_weight, None, None, router_text),
        "router_forward": lambda: triton_router.router_forward(x, router_weight, None, None, router_spec),
    }
    if router_impl is not None:
        pieces["router_impl"] = lambda: router_impl(x, router_weight, None, None, router_text)
    if impl is not None:
        pieces["impl"] = lambda: impl(x, ids, w, w_up, w_down, None, None, [], text)
    results = {name: median_us(fn, args.calls) for name, fn in pieces.items()}
    if args.back_to_back:
        results.update({f"{name}_b2b": back_to_back_us(fn, args.calls) for name, fn in pieces.items()})
    # every module that imported launch by name gets the timed one for this measurement
    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("uniep_dynamo") and getattr(m, "launch", None) is real_launch]
    for m in patched:
        m.launch = timed_launch
    try:
        times = []
        for _ in range(args.calls):
            times.append(to_first_launch())
            torch.cuda.synchronize()
        times.sort()
        results["to_first_launch"] = round(times[len(times) // 2] * 1e6, 1)
    finally:
        for m in patched:
            m.launch = real_launch
    print(json.dumps({"shape": args.shape, "gpu": torch.cuda.get_device_name(0), "us": results}, indent=1))
    if args.cprofile:
        for name in ("op", "op_inference", "block_inference", "router"):
            python_profile(pieces[name], name, args.cprofile)
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
