"""Host time of one MegaKernel GEMM launch, and where it goes (issue 4: the compiled EP exchange is bound by
host time). On one GPU, with a routing plan that routes no rows (the kernels return at once, so the loop
measures the host and not the GPU):

  wrapper     megakernel.rows_gemm / _weight_grad (the op's own call: arguments, descriptors, the launch by
              kernels/launch.py); wrapper_triton_launch: the same through kernel[grid](...)
  jit         the same Triton kernel called as kernel[grid](...) with the arguments ready
  launch      the same through kernels/launch.py's launch (Triton's binder, then the compiled kernel's launcher)
  bound       the compiled kernel's launcher called directly with the bound arguments Triton computed once
              (what a cached launch path could reach; skipped where this Triton's internals differ)
  grouped_mm  torch._grouped_mm on the same operands (the CUTLASS path's launch, for comparison)
  events      torch.cuda.Event().record() and wait_event on a side stream (the exchange's bookkeeping)

and a cProfile of the wrapper's calls, by function.

    python benchmarks/probes/launch_probe.py [--calls 2000]
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    import triton

    import uniep_dynamo  # noqa: F401
    from uniep_dynamo.kernels import megakernel
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.kernels.triton_gemm import STORE
    from uniep_dynamo.kernels.triton_gemm import _rows_gemm as rows_kernel
    from uniep_dynamo.spec import ExpertsSpec, decode_spec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "launch_probe.json"))
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    # a chunk of Qwen3-30B-A3B's exchange on 2 ranks: 64 local experts, 2048 tokens x 8 slots
    tokens, top_k, experts, hidden, inter = 2048, 8, 64, 2048, 768
    spec = decode_spec(ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), dtype).encode())
    w_up = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype)
    w_down = torch.randn(experts, hidden, inter, device=dev, dtype=dtype)
    layer = megakernel.Layer(torch.empty(tokens, hidden, device=dev, dtype=dtype), (tokens, top_k), w_up, w_down,
                             spec)
    cfg = layer.config.down
    act = torch.randn(tokens * top_k, inter, device=dev, dtype=dtype)
    out = torch.empty(tokens * top_k, hidden, device=dev, dtype=dtype)
    offsets = torch.zeros(experts, device=dev, dtype=torch.int64)  # no rows routed: each program returns
    row_order = torch.zeros(tokens * top_k, device=dev, dtype=torch.int64)

    def wrapper():
        megakernel.rows_gemm(layer, cfg, a=act, gather=False, row_order=row_order, b=layer.down_eff, n=hidden,
                             k=inter, epilogue=STORE, c=out, offsets=offsets)

    b = layer.down_eff
    grid = megakernel._grid((triton.cdiv(layer.num_slots, cfg.block_m) + experts) * triton.cdiv(hidden, cfg.block_n),
                            cfg)
    pos = (act, act.stride(0), act.stride(1), row_order, top_k, b, b.stride(0), b.stride(1), b.stride(2), out, 0,
           offsets, experts, hidden, inter, out, out.stride(0), out, out.stride(0), out, out.stride(0), out, 0)
    kw = dict(COL_MULT=1, act_alpha=0.0, act_limit=0.0, act_up_add=0.0, GATHER=False, A_SCALE=False, EPILOGUE=STORE,
              ACT=0, TWO_HALVES=False, TWO_ACC=False, PACKED=False, HAS_BIAS=False, DOT_PRECISION="tf32",
              EVEN_K=inter % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              BLOCK_E=layer.block_e, GROUP_M=cfg.group_m, num_programs=grid, num_warps=cfg.num_warps,
              num_stages=cfg.num_stages)

    def jit():
        return rows_kernel[(grid,)](*pos, **kw)

    from uniep_dynamo.kernels import launch as launch_mod

    results = {"wrapper_us": _per_call_us(wrapper, args.calls), "jit_us": _per_call_us(jit, args.calls),
               "launch_us": _per_call_us(lambda: launch_mod.launch(rows_kernel, (grid,), *pos, **kw), args.calls)}
    launch_mod.FAST = False  # uniep's wrapper through kernel[grid](...), as before kernels/launch.py
    results["wrapper_triton_launch_us"] = _per_call_us(wrapper, args.calls)
    launch_mod.FAST = True

    compiled = jit()
    try:
        caches = rows_kernel.device_caches[torch.cuda.current_device()]
        binder = caches[-1]
        bound = binder(*pos, **kw)[0]
        values = list(bound.values())
        from triton import knobs

        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        stream = torch.cuda.current_stream().cuda_stream
        meta = compiled.launch_metadata((grid, 1, 1), stream, *values)

        def direct():
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *values)

        results["bound_us"] = _per_call_us(direct, args.calls)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            binder(*pos, **kw)
        results["binder_only_us"] = (time.perf_counter() - t0) / args.calls * 1e6
        results["bound_arg_count"] = len(values)
    except Exception as exc:  # noqa: BLE001 -- another Triton's internals: report and go on
        import inspect

        results["bound_error"] = repr(exc)
        print(inspect.getsource(type(rows_kernel).run), file=sys.stderr)

    x3 = torch.randn(tokens * top_k, inter, device=dev, dtype=dtype)
    w3 = torch.randn(experts, inter, hidden, device=dev, dtype=dtype)
    offs32 = torch.zeros(experts, device=dev, dtype=torch.int32)
    results["grouped_mm_us"] = _per_call_us(lambda: torch._grouped_mm(x3, w3, offs=offs32), args.calls)
    side = torch.cuda.Stream()

    def events():
        e = torch.cuda.Event()
        e.record()
        side.wait_event(e)

    results["event_record_wait_us"] = _per_call_us(events, args.calls)
    results["empty_us"] = _per_call_us(lambda: torch.empty(tokens * top_k, hidden, device=dev, dtype=dtype), args.calls)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        wrapper()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(18)
    results.update(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                   python=sys.version.split()[0])
    print(json.dumps(results, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
