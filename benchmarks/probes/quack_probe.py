"""Can QuACK's persistent, warp-specialized grouped GEMMs (CuTe DSL, ``quack-kernels`` on PyPI) replace the grouped GEMMs
uniep runs today, with the same bits? (issue 39, step 2)

For each shape, the six GEMMs of one MoE experts layer over uniep's routing plan (rows in expert, token, k order):

    up          X[tok(r)] @ W_up[e]          today: a row gather, then torch._grouped_mm (CUTLASS)
    down        act @ W_down[e]              torch._grouped_mm
    grad_act    dY_rows @ W_down[e]^T        torch._grouped_mm
    grad_input  dH @ W_up[e]^T               Triton (torch._grouped_mm gives the same bits)
    wgrad_down  act_e^T @ dY_rows_e          torch._grouped_mm, K = the expert's rows
    wgrad_up    X[tok]_e^T @ dH_e            a row gather, then torch._grouped_mm
    grad_act_gather, wgrad_down_gather       grad_act and wgrad_down as late_routing_weight runs them: the output
                                             gradient's rows gathered by token (--gemms names them)

each by torch._grouped_mm and by QuACK (``varlen_m`` / ``varlen_k``; the gathers inside the GEMM through its
``A_idx``), QuACK autotuned over its Hopper configs (compiled in parallel worker processes) or at its default config.
Prints, and writes to $OUT/quack_probe.json, the milliseconds of each, whether QuACK's output equals
torch._grouped_mm's bit for bit, and the timing of every config QuACK tried.

    python benchmarks/probes/quack_probe.py --shapes qwen3-30b-a3b,qwen3-30b-a3b@32768,olmoe,mixtral
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_layer import SHAPES, make_inputs  # noqa: E402

from uniep_dynamo.tuner import time_cuda  # noqa: E402


def plan(ids, num_experts):
    """(token of each expert-sorted row as int32, [0, end row of each expert] as int32): uniep's stable plan."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0)
    tok = (order // ids.shape[1]).to(torch.int32)
    cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return tok, cu


def gemms(x, tok, cu, w_up, w_down):
    """name -> (torch._grouped_mm GEMM alone, the glue it needs first or None, QuACK's call kwargs)."""
    R = tok.numel()
    I = w_down.shape[2]
    offs = cu[1:]
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = x.index_select(0, tok)
    act = torch.randn(R, I, device="cuda", dtype=x.dtype, generator=g)
    dys = torch.randn(R, x.shape[1], device="cuda", dtype=x.dtype, generator=g)
    dh = torch.randn(R, w_up.shape[1], device="cuda", dtype=x.dtype, generator=g)
    up_b, down_b = w_up.transpose(1, 2), w_down.transpose(1, 2)  # [E, H, 2I], [E, I, H]: K x N per expert
    d_out = torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g)  # the layer's output gradient, [T, H]
    d_outs = d_out.index_select(0, tok)
    mm = torch._grouped_mm
    return {
        "up": (lambda: mm(xs, up_b, offs=offs), lambda: x.index_select(0, tok),
               dict(A=x, B=up_b, cu_seqlens_m=cu, A_idx=tok), dict(A=xs, B=up_b, cu_seqlens_m=cu)),
        "down": (lambda: mm(act, down_b, offs=offs), None, dict(A=act, B=down_b, cu_seqlens_m=cu), None),
        "grad_act": (lambda: mm(dys, w_down, offs=offs), None, dict(A=dys, B=w_down, cu_seqlens_m=cu), None),
        "grad_input": (lambda: mm(dh, w_up, offs=offs), None, dict(A=dh, B=w_up, cu_seqlens_m=cu), None),
        "wgrad_down": (lambda: mm(act.t(), dys, offs=offs), None, dict(A=act.t(), B=dys, cu_seqlens_k=cu), None),
        "wgrad_up": (lambda: mm(xs.t(), dh, offs=offs), lambda: x.index_select(0, tok),
                     dict(A=x.t(), B=dh, cu_seqlens_k=cu, A_idx=tok), dict(A=xs.t(), B=dh, cu_seqlens_k=cu)),
        # under late_routing_weight: the unweighted output-gradient rows gathered by token in the activation-gradient
        # GEMM and in the down weight's gradient (as [E, H, I] = dY_e^T (w * act)_e)
        "grad_act_gather": (lambda: mm(d_outs, w_down, offs=offs), lambda: d_out.index_select(0, tok),
                            dict(A=d_out, B=w_down, cu_seqlens_m=cu, A_idx=tok),
                            dict(A=d_outs, B=w_down, cu_seqlens_m=cu)),
        "wgrad_down_gather": (lambda: mm(d_outs.t(), act, offs=offs), lambda: d_out.index_select(0, tok),
                              dict(A=d_out.t(), B=act, cu_seqlens_k=cu, A_idx=tok),
                              dict(A=d_outs.t(), B=act, cu_seqlens_k=cu)),
    }


def out_like(kw, E):
    A, B = kw["A"], kw["B"]
    if "cu_seqlens_m" in kw:
        rows = kw["A_idx"].numel() if "A_idx" in kw else A.shape[0]
        return torch.empty(rows, B.shape[-1], dtype=A.dtype, device=A.device)
    return torch.empty(E, A.shape[0], B.shape[-1], dtype=A.dtype, device=A.device)


def config_text(c):
    return (f"{c.tile_m}x{c.tile_n} {'pingpong' if c.pingpong else 'coop'} cluster {c.cluster_m}x{c.cluster_n}"
            + (" swap_ab" if c.swap_ab else ""))


def uniep_config(name, overrides):
    """The QuACK config uniep's GPU heuristics give GEMM ``name`` (config.QUACK_CONFIGS), or ``overrides[name]``."""
    from uniep_dynamo.kernels import quack_gemm
    from uniep_dynamo.kernels.config import QUACK_CONFIGS

    text = overrides.get(name) or QUACK_CONFIGS[name.replace("_gather", "")]
    if name.endswith("_gather") or name in ("up", "wgrad_up"):  # QuACK's gather takes one CTA along N
        tile, kind, cluster = text.split("/")
        text = f"{tile}/{kind}/{cluster if cluster.endswith('x1') else '1x1'}"
    return quack_gemm._config(text)


def run_quack(kw, E, mode, iters, config=None):
    """(ms at the chosen config, the chosen config's text, {config text: ms} of every config tried, output).
    ``config``: the one to run with where ``mode`` is "uniep"."""
    from quack.gemm_interface import gemm_tuned
    try:
        from quack.gemm_interface import default_config
    except ImportError:  # moved in later releases
        from quack.gemm_config import default_config

    out = out_like(kw, E)
    tried = {}
    rest = {k: v for k, v in kw.items() if k not in ("A", "B")}
    if mode == "autotune":  # positional tensors: QuACK's parallel precompile reads their metadata from args
        gemm_tuned(kw["A"], kw["B"], out, **rest)
        config = gemm_tuned.best_config.kwargs["config"]
        for c, t in (getattr(gemm_tuned, "configs_timings", None) or {}).items():
            tried[config_text(c.kwargs["config"])] = round(float(t[0] if isinstance(t, (list, tuple)) else t), 4)
    elif mode != "uniep":
        config = default_config(out.device)

    def call():
        gemm_tuned.fn(kw["A"], kw["B"], out, config=config, **rest)

    ms = time_cuda(call, iters, 5)
    call()
    return ms, config_text(config), tried, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--mode", choices=("autotune", "default", "uniep"), default="autotune",
                        help="uniep: the configs uniep's GPU heuristics give each GEMM (config.QUACK_CONFIGS)")
    parser.add_argument("--configs", default="", help="with --mode uniep: JSON {gemm: config text} instead of "
                        "the heuristics' (quack_gemm.parse_config's form, e.g. '128x192/pingpong/1x2')")
    parser.add_argument("--gemms", default="up,down,grad_act,grad_input,wgrad_down,wgrad_up")
    parser.add_argument("--budget-s", type=float, default=500.0, help="stop starting new shapes after this")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quack_probe.json"))
    args = parser.parse_args()
    import quack

    overrides = json.loads(args.configs) if args.configs else {}
    start = time.time()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / time_cuda(lambda: a @ a, 20, 5) / 1e9
    del a
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "quack": quack.__version__,
            "peak_tflops": round(peak, 1), "mode": args.mode, "configs": overrides, "rows": []}
    print(f"# {data['device']}, torch {torch.__version__}, quack {quack.__version__}, matmul peak {peak:.1f} TF/s")
    print(f"{'shape':<24} {'gemm':<11} {'glue':>7} {'grouped_mm':>10} {'quack':>8} {'q no-gather':>11} "
          f"{'today':>8} {'ratio':>6} bits  config")
    for spec in args.shapes.split(","):
        if time.time() - start > args.budget_s:
            print(f"# budget spent; {spec} and later shapes left out")
            break
        name, _, t = spec.partition("@")
        T = int(t) if t else args.tokens
        H, I, E, K = SHAPES[name]
        x, ids, _, _ = make_inputs(H, I, E, K, T, torch.bfloat16, "cuda")
        g = torch.Generator(device="cuda").manual_seed(2)
        w_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
        w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
        tok, cu = plan(ids, E)
        for gname, (base, glue, kw, kw_nogather) in gemms(x, tok, cu, w_up, w_down).items():
            if gname not in args.gemms.split(","):
                continue
            row = {"shape": spec, "gemm": gname}
            base_ms = time_cuda(base, args.iters, 5)
            glue_ms = time_cuda(glue, args.iters, 5) if glue else 0.0
            expected = base()
            try:
                fixed = uniep_config(gname, overrides) if args.mode == "uniep" else None
                q_ms, config, tried, out = run_quack(kw, E, args.mode, args.iters, fixed)
                row.update(quack_ms=round(q_ms, 4), config=config, tried=tried,
                           bitwise=bool(torch.equal(out.view(expected.shape), expected)),
                           max_abs=float((out.view(expected.shape).float() - expected.float()).abs().max()))
                if kw_nogather is not None:
                    q2, config2, _, out2 = run_quack(kw_nogather, E, args.mode, args.iters, fixed)
                    row.update(quack_nogather_ms=round(q2, 4), config_nogather=config2,
                               bitwise_nogather=bool(torch.equal(out2.view(expected.shape), expected)))
            except Exception as e:  # a config or layout QuACK refuses: recorded, the probe goes on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            row.update(grouped_mm_ms=round(base_ms, 4), glue_ms=round(glue_ms, 4))
            today = base_ms + glue_ms
            best = min([v for v in (row.get("quack_ms"), row.get("quack_nogather_ms", 0) + glue_ms
                                    if "quack_nogather_ms" in row else None) if v is not None], default=None)
            print(f"{spec:<24} {gname:<11} {glue_ms:7.3f} {base_ms:10.3f} {row.get('quack_ms', float('nan')):8.3f} "
                  f"{row.get('quack_nogather_ms', float('nan')):11.3f} {today:8.3f} "
                  f"{(today / best) if best else float('nan'):6.3f} {str(row.get('bitwise', '-')):<5} "
                  f"{row.get('config', row.get('error', ''))}", flush=True)
            data["rows"].append(row)
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
        del x, ids, w_up, w_down
        torch.cuda.empty_cache()
    print(f"# {time.time() - start:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
