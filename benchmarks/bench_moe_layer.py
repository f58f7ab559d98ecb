"""One MoE experts layer, forward + backward, baselines and uniep side by side in one run.

Providers (bf16, HF weight layout [E, 2I, H] / [E, H, I], routing from a softmax-top-k router):
  hf_grouped_mm            HF's default experts implementation, eager
  hf_grouped_mm_inductor   the same module under torch.compile (inductor)
  sort_grouped_mm_inductor the strongest PyTorch-native path: stable sort + torch._grouped_mm + gather combine,
                           under inductor
  liger_fused_moe          Liger-Kernel's Triton fused MoE (if liger_kernel is installed)
  uniep                    the same HF module under torch.compile(backend="uniep") (the Triton MegaKernel)
  uniep_reference          the same compiled module with UNIEP_KERNELS=reference (the PyTorch reference op)

For each: median time of fwd+bwd over --iters runs (CUDA events, the GPU idle before each), the mean over
--iters runs issued back to back (as a training loop issues them), TFLOP/s (fwd 2*T*K*3*H*I, bwd twice that,
over the median), peak memory above the inputs, and whether two runs give bitwise equal output and gradients.

    python benchmarks/bench_moe_layer.py --shapes mixtral,qwen3-30b-a3b,qwen3-30b-a3b@32768 --out results.json

A shape may carry its own token count after "@"; --tokens sets the others.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from uniep_dynamo.tuner import time_cuda  # noqa: F401 (the tuner's timing loop; other benchmarks import it from here)


def time_cuda_back_to_back(step, steps: int) -> float:
    """Mean ms of ``steps`` calls of ``step()`` issued back to back, with no synchronization between them (CUDA
    events around the whole run, as a training loop runs them)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps

SHAPES = {  # name: (hidden H, expert intermediate I, experts E, top-k K)
    "mixtral": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}


def make_inputs(H, I, E, K, T, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    router = torch.randn(E, H, device=device, dtype=dtype, generator=g) * 0.02
    probs = torch.softmax((x @ router.t()).float(), -1)
    w, ids = torch.topk(probs, K, -1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    grad_out = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    return x, ids, w, grad_out


def hf_experts(H, I, E, K, dtype, device, implementation="grouped_mm"):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    experts = MixtralExperts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    return experts


def sort_grouped_mm(x, ids, w, w13, w2):
    """Stable sort + torch._grouped_mm + gather combine (fp32 sum over k)."""
    T, K = ids.shape
    E = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
    xs = x[order // K]
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, -1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = y[inv].view(T, K, -1)
    return (y.float() * w.float().unsqueeze(-1)).sum(1).to(x.dtype)


def providers(experts):
    out = {}
    out["hf_grouped_mm"] = lambda x, ids, w: experts(x, ids, w)
    compiled = torch.compile(experts)
    out["hf_grouped_mm_inductor"] = lambda x, ids, w: compiled(x, ids, w)
    ref = torch.compile(sort_grouped_mm)
    out["sort_grouped_mm_inductor"] = lambda x, ids, w: ref(x, ids, w, experts.gate_up_proj, experts.down_proj)
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        out["liger_fused_moe"] = lambda x, ids, w: LigerFusedMoEFunction.apply(
            x, experts.gate_up_proj, experts.down_proj, ids.to(torch.int32), w)
    except Exception as exc:  # noqa: BLE001
        print(f"# liger_fused_moe unavailable: {exc!r}", file=sys.stderr)
    import uniep_dynamo  # noqa: F401

    uniep = torch.compile(experts, backend="uniep")
    out["uniep"] = lambda x, ids, w: uniep(x, ids, w)

    def uniep_reference(x, ids, w):
        os.environ["UNIEP_KERNELS"] = "reference"
        try:
            return uniep(x, ids, w)
        finally:
            os.environ.pop("UNIEP_KERNELS")

    out["uniep_reference"] = uniep_reference
    return out


def step(fn, experts, x, ids, w, grad_out):
    def run():
        for p in experts.parameters():
            p.grad = None
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        out = fn(xx, ids, ww)
        if fn.__name__ == "uniep_reference":  # its backward must run the reference too
            os.environ["UNIEP_KERNELS"] = "reference"
        try:
            out.backward(grad_out)
        finally:
            os.environ.pop("UNIEP_KERNELS", None)
        return out, xx.grad, ww.grad, experts.gate_up_proj.grad, experts.down_proj.grad
    return run


def max_rel(actual, expected) -> float:
    """max |a - e| / max |e|, one leading slice at a time (DeepSeek-V3's weight gradients are 14 GB)."""
    diff = scale = 0.0
    for a, e in zip(actual.reshape(actual.shape[0], -1), expected.reshape(expected.shape[0], -1)):
        diff = max(diff, (a.float() - e.float()).abs().max().item())
        scale = max(scale, e.float().abs().max().item())
    return diff / max(scale, 1e-12)


def profile(run, label, rows=25):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"# {label}: top CUDA kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def bench_shape(name, T, iters, warmup, dtype, device, skip=(), profile_providers=(), peak_tflops=None):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no automatic-dynamic carry-over from the previous shape
    counters.clear()
    H, I, E, K = SHAPES[name]
    experts = hf_experts(H, I, E, K, dtype, device)
    x, ids, w, grad_out = make_inputs(H, I, E, K, T, dtype, device)
    flops = 3 * 2 * T * K * 3 * H * I
    row = {"shape": name if T == 8192 else f"{name}@{T}", "T": T, "H": H, "I": I, "E": E, "K": K, "dtype": str(dtype).replace("torch.", "")}
    reference = None
    for pname, fn in providers(experts).items():
        if pname in skip:
            continue
        try:
            run = step(fn, experts, x, ids, w, grad_out)
            t0 = time.time()
            run()  # compile
            row[f"{pname}_first_call_s"] = round(time.time() - t0, 2)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_cuda(run, iters, warmup)
            row[f"{pname}_peak_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            # the same steps issued back to back, as a training loop runs them (no GPU idle while the host
            # issues a step's first kernels)
            row[f"{pname}_back_to_back_ms"] = round(time_cuda_back_to_back(run, iters), 3)
            a = [t.detach().clone() for t in run()]
            b = [t.detach().clone() for t in run()]
            row[f"{pname}_ms"] = round(ms, 3)
            row[f"{pname}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
            if peak_tflops:
                row[f"{pname}_pct_peak"] = round(100 * row[f"{pname}_tflops"] / peak_tflops, 1)
            row[f"{pname}_bitwise"] = all(torch.equal(p, q) for p, q in zip(a, b))
            if pname == "uniep":
                row["uniep_rewrites"] = counters["uniep"]["moe_experts"]
            if pname in profile_providers:
                profile(run, f"{name} {pname}")
            if reference is None:
                reference = a
            else:
                row[f"{pname}_max_rel_vs_hf"] = round(max(max_rel(p, q) for p, q in zip(a, reference)), 4)
        except Exception as exc:  # noqa: BLE001
            row[pname] = "ERR " + repr(exc)[:300]
        torch.cuda.empty_cache()
    return row


def print_table(rows):
    names = [k[:-3] for k in rows[0] if k.endswith("_ms") and not k.endswith("_back_to_back_ms")] if rows else []
    print("ms synchronized per step (back to back), TFLOP/s of the synchronized time")
    print(f"{'shape':16s} " + " ".join(f"{n:>36s}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            ms, b2b = row.get(f"{n}_ms"), row.get(f"{n}_back_to_back_ms")
            cells.append(f"{ms:9.3f} ({b2b:9.3f}) ms {row.get(f'{n}_tflops', 0):6.1f} TF/s"
                         if isinstance(ms, float) and isinstance(b2b, float) else "ERR")
        print(f"{row['shape']:16s} " + " ".join(f"{c:>36s}" for c in cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip", default="", help="providers to leave out, comma separated")
    parser.add_argument("--profile", default="", help="providers to profile (top CUDA kernels), comma separated")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_moe_layer.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_layer: needs a CUDA GPU")
    device, dtype = "cuda", torch.bfloat16
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    peak_ms = time_cuda(lambda: a @ a, 10, 3)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "bf16_matmul_tflops": round(2 * 8192**3 / (peak_ms * 1e-3) / 1e12, 1)}
    try:
        import transformers
        import triton
        meta.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    print(json.dumps(meta))
    rows = []
    for spec in args.shapes.split(","):
        name, _, tokens = spec.partition("@")
        row = bench_shape(name, int(tokens or args.tokens), args.iters, args.warmup, dtype, device,
                          skip=tuple(filter(None, args.skip.split(","))),
                          profile_providers=tuple(filter(None, args.profile.split(","))),
                          peak_tflops=meta["bf16_matmul_tflops"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print_table(rows)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
