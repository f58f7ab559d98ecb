"""Why do the two wide GEMMs of a many-expert layer (the up projection, X[tok] @ W_up[e]^T, and its weight gradient,
X[tok]_e^T dH_e) run at about 65% of the matmul by QuACK, where the same work as one cuBLAS ``bmm`` over equal experts
runs near 85%? (issue 39)

For each shape, uniform routing (exactly T*K/E rows an expert, so that ``bmm`` does the same work) and the routing of
bench_moe_layer.py, each GEMM by:

  bmm            cuBLAS, one batched matmul over equal experts (uniform routing only)
  grouped_mm     torch._grouped_mm (CUTLASS) on pre-gathered rows
  quack s<N>     QuACK's varlen GEMM at uniep's config (config.QUACK_CONFIGS), launched as quack_gemm._direct launches
                 it, with the persistent tile scheduler's swizzle group N (QuACK's default 8: that many tile columns
                 run side by side before the next row of tiles; a runtime argument, the same compiled kernel)
  quack nogather QuACK at uniep's config on pre-gathered rows (no A_idx)
  quack batched  QuACK's batched (not varlen) GEMM over equal experts (uniform routing only)
  quack <cfg>    QuACK varlen at another config (``--configs``), and on pre-gathered rows ("<cfg> nogather")
  gather copy    the token rows' gather that "nogather" reads (index_select into a [rows, H] buffer)

ms a call from CUDA events around ``--calls`` calls back to back (median of ``--rounds``), TF/s, and whether the output
equals the first QuACK row's bit for bit (scheduling must not change bits). Writes $OUT/gemm_schedule_probe.json.

    python benchmarks/probes/gemm_schedule_probe.py --shapes qwen3-30b-a3b,olmoe [--gemms up,wgrad_up,down]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_layer import SHAPES, make_inputs  # noqa: E402
from quack_probe import plan  # noqa: E402  (uniep's stable plan: each row's token, the group bounds)


def back_to_back_ms(run, calls: int, rounds: int) -> float:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


def quack_call(a, b, out, config: str, swizzle: int, cu_seqlens_m=None, cu_seqlens_k=None, a_idx=None):
    """quack_gemm._direct's launch with the scheduler's swizzle group ``swizzle``."""
    from uniep_dynamo.kernels import quack_gemm as q

    parts = q._direct_parts()
    varlen_m = cu_seqlens_m is not None
    b_t = b.mT
    if varlen_m:
        b_p, d_p = b_t.permute(1, 2, 0), out
    else:
        b_p, d_p = b_t, out.permute(1, 2, 0)
    majors = (q._major(a, "m", "k"), q._major(b_p, "n", "k"), q._major(d_p, "m", "n"))
    capacity = parts[7](a.device)
    kernel, epi, _ = q._launcher(config, varlen_m, a_idx is not None, *majors, (a.dtype, b.dtype, out.dtype),
                                 capacity, ())
    cm, cn = q.parse_config(config)[3:]
    sched = parts[4](parts[1](cm * cn, device_capacity=capacity), swizzle, None, None)
    varlen = parts[6](mCuSeqlensM=cu_seqlens_m, mCuSeqlensK=cu_seqlens_k, mAIdx=a_idx)

    def run():
        kernel(a, b_p, d_p, None, epi, sched, varlen, None)
    return run


def quack_variants(runs, quack, default: str, configs, swizzles, gathered=True) -> None:
    """QuACK's rows: uniep's config at each swizzle group of ``swizzles``, and at each other config of ``configs``;
    each config also on pre-gathered rows where the GEMM gathers (``gathered``)."""
    for s in swizzles:
        runs[f"quack s{s}"] = quack(default, s)
    if gathered:
        runs["quack nogather"] = quack(default, 8, gather=False)
    for other in configs:
        if other == default:
            continue
        runs[f"quack {other}"] = quack(other, 8)
        if gathered:
            runs[f"quack {other} nogather"] = quack(other, 8, gather=False)


def gather_config(text: str) -> str:
    """QuACK's gather takes one CTA along N: a 1xN cluster becomes 1x1 (as uniep's _use_quack does)."""
    tile, kind, cluster = text.split("/")
    return f"{tile}/{kind}/{cluster if cluster.endswith('x1') else '1x1'}"


def cases(name, x, tok, cu, w_up, w_down, E, uniform, configs=(), swizzles=(8, 1, 2, 4, 16, 32)):
    """(flops, {label: run}) for GEMM ``name``; every run writes its output into a fresh tensor it returns."""
    from uniep_dynamo.kernels.config import QUACK_CONFIGS

    R, H = tok.numel(), x.shape[1]
    I2 = w_up.shape[1]
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = x.index_select(0, tok.long())
    offs = cu[1:]
    mm = torch._grouped_mm
    runs = {}
    if name == "up":  # [R, 2I] = X[tok] @ W_up[e]^T; W_up [E, 2I, H] (HF)
        flops = 2.0 * R * H * I2
        b = w_up.transpose(1, 2)  # [E, H, 2I] as K x N, K-contiguous
        if uniform:
            xe = xs.view(E, R // E, H)
            runs["bmm"] = lambda: torch.bmm(xe, b)
        runs["grouped_mm"] = lambda: mm(xs, b, offs=offs)
        rows, tok_l = torch.empty_like(xs), tok.long()
        runs["gather copy"] = lambda: torch.index_select(x, 0, tok_l, out=rows)  # what nogather needs first

        def quack(config, swizzle, gather=True):
            out = torch.empty(R, I2, dtype=x.dtype, device=x.device)
            cfg = gather_config(config) if gather else config
            launch = quack_call(x if gather else xs, b, out, cfg, swizzle, cu_seqlens_m=cu,
                                a_idx=tok if gather else None)
            return lambda: (launch(), out)[1]
        default = QUACK_CONFIGS["up"]
        quack_variants(runs, quack, default, configs, swizzles)
        if uniform:
            from uniep_dynamo.kernels import quack_gemm as q
            from quack.gemm_interface import gemm_tuned
            xe3 = xs.view(E, R // E, H)
            out3 = torch.empty(E, R // E, I2, dtype=x.dtype, device=x.device)
            cfg = q._config(default)
            runs["quack batched"] = lambda: (gemm_tuned.fn(xe3, b, out3, config=cfg), out3)[1]
    elif name == "wgrad_up":  # grad [E, 2I, H] (HF) written through its [E, H, 2I] m-major view, as uniep does
        flops = 2.0 * R * H * I2
        dh = torch.randn(R, I2, device=x.device, dtype=x.dtype, generator=g)
        if uniform:
            xe = xs.view(E, R // E, H)
            de = dh.view(E, R // E, I2)
            runs["bmm"] = lambda: torch.bmm(de.transpose(1, 2), xe)  # [E, 2I, H]
        runs["grouped_mm"] = lambda: mm(dh.t(), xs, offs=offs)  # [E, 2I, H]

        def quack(config, swizzle, gather=True):
            grad = torch.empty(E, I2, H, dtype=x.dtype, device=x.device)
            launch = quack_call((x if gather else xs).t(), dh, grad.transpose(1, 2),
                                gather_config(config) if gather else config, swizzle, cu_seqlens_k=cu,
                                a_idx=tok if gather else None)
            return lambda: (launch(), grad)[1]
        quack_variants(runs, quack, QUACK_CONFIGS["wgrad_up"], configs, swizzles)
    elif name == "down":  # [R, H] = act @ W_down[e]^T; W_down [E, H, I]
        I = w_down.shape[2]
        flops = 2.0 * R * H * I
        act = torch.randn(R, I, device=x.device, dtype=x.dtype, generator=g)
        b = w_down.transpose(1, 2)  # [E, I, H]
        if uniform:
            ae = act.view(E, R // E, I)
            runs["bmm"] = lambda: torch.bmm(ae, b)
        runs["grouped_mm"] = lambda: mm(act, b, offs=offs)

        def quack(config, swizzle):
            out = torch.empty(R, H, dtype=x.dtype, device=x.device)
            launch = quack_call(act, b, out, config, swizzle, cu_seqlens_m=cu)
            return lambda: (launch(), out)[1]
        quack_variants(runs, quack, QUACK_CONFIGS["down"], configs, swizzles, gathered=False)
    else:
        raise SystemExit(f"unknown GEMM {name}")
    return flops, runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe")
    parser.add_argument("--gemms", default="up,wgrad_up,down")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--routings", default="uniform,bench")
    parser.add_argument("--configs", default="", help="other QuACK configs, comma-separated ('space': "
                        "tuner.QUACK_SPACE); each compiles once (tens of seconds); a gathered GEMM turns 1xN into 1x1")
    parser.add_argument("--swizzles", default="8,1,2,4,16,32", help="the scheduler's swizzle groups at uniep's config")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm_schedule_probe.json"))
    args = parser.parse_args()
    swizzles = tuple(int(v) for v in args.swizzles.split(","))
    dtype, dev = torch.bfloat16, torch.device("cuda")
    if args.configs == "space":
        from uniep_dynamo.tuner import QUACK_SPACE
        configs = QUACK_SPACE
    else:
        configs = tuple(c for c in args.configs.split(",") if c)

    square = [torch.randn(8192, 8192, device=dev, dtype=dtype)]
    peak_ms = back_to_back_ms(lambda: square[0] @ square[0], 10, args.rounds)
    peak = 2 * 8192 ** 3 / peak_ms / 1e9
    square.clear()
    print(f"matmul 8192^3: {peak:.1f} TF/s back to back", flush=True)
    results = {"peak_tflops": round(peak, 1), "rows": []}
    for shape in args.shapes.split(","):
        H, I, E, K = SHAPES[shape]
        T = args.tokens
        x, ids, _, _ = make_inputs(H, I, E, K, T, dtype, dev)
        g = torch.Generator(device=dev).manual_seed(3)
        w_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype, generator=g) * 0.02
        w_down = torch.randn(E, H, I, device=dev, dtype=dtype, generator=g) * 0.02
        for routing in args.routings.split(","):
            if routing == "uniform":  # token t's k-th expert (t * K + k) mod E: exactly T*K/E rows an expert
                ids_r = (torch.arange(T * K, device=dev) % E).view(T, K)
            else:
                ids_r = ids
            tok, cu = plan(ids_r, E)
            counts = (cu[1:] - cu[:-1]).long()
            tiles = {m: int(((counts + m - 1) // m).sum()) for m in (64, 128, 192, 256)}
            fill = {m: round(float(counts.sum()) / (t * m), 3) for m, t in tiles.items()}
            print(f"{shape:<14} {routing:<8} rows an expert {int(counts.min())}-{int(counts.max())}; row tiles "
                  + ", ".join(f"{m}: {t} ({100 * fill[m]:.1f}% of rows used)" for m, t in tiles.items()), flush=True)
            results.setdefault("tiles", []).append(dict(shape=shape, routing=routing, min_rows=int(counts.min()),
                                                        max_rows=int(counts.max()), tiles=tiles, fill=fill))
            for gname in args.gemms.split(","):
                flops, runs = cases(gname, x, tok, cu, w_up, w_down, E, routing == "uniform", configs,
                                    swizzles)
                ref = None
                for label, run in runs.items():
                    try:
                        ms = back_to_back_ms(run, args.calls, args.rounds)
                        out = run()
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 -- a config this QuACK refuses: say so, go on
                        print(f"{shape:<14} {routing:<8} {gname:<9} {label:<28} failed: {exc!r}"[:200], flush=True)
                        continue
                    same = None
                    if label.startswith("quack"):
                        if ref is None:
                            ref = out.clone()
                        same = bool(torch.equal(out.reshape(ref.shape), ref)) if out.numel() == ref.numel() else None
                    tf = flops / ms / 1e9
                    row = dict(shape=shape, routing=routing, gemm=gname, provider=label, ms=round(ms, 4),
                               tflops=round(tf, 1), share=round(tf / peak, 3), bitwise_vs_first_quack=same)
                    results["rows"].append(row)
                    print(f"{shape:<14} {routing:<8} {gname:<9} {label:<28} {ms:8.4f} ms {tf:7.1f} TF/s "
                          f"{100 * tf / peak:5.1f}%  same bits: {same}", flush=True)
                del runs
                torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
