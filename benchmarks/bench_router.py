"""The router alone and the whole MoE layer: eager and inductor baselines beside uniep in one run.

Part 1, routing time: HF's own router module (bf16) of each family at its model's sizes, forward only
and forward + backward (gradient of the routing weights), at T=8192 and at T=128 (decoding-sized
batches, where launches dominate). Providers:
  eager      the HF module
  inductor   torch.compile(router)                       (the unfused router as inductor compiles it)
  uniep      torch.compile(router, backend="uniep")      (uniep.moe_router: the fused routing kernel)
Two timings each: wall time per call (CUDA events around the call: on these microsecond kernels it is
mostly host time, Dynamo's guards and the autograd engine included), and the time of one replay of the
calls captured in a CUDA graph (the device's own time: kernels and the gaps between them, no host
work). Each uniep row also says how many tokens chose other experts than eager (exact ties aside, none
should) and the largest relative difference of the routing weights.

Part 2, whole-layer effect: the HF sparse MoE block (router + experts) at T=8192, forward + backward,
under inductor, under uniep with the router left to inductor (rewrite_router=False), under uniep with
both rewritten but the experts op sorting the ids itself (share_routing_plan=False), and under uniep
with the router op building the plan for the experts op (the default).

    python benchmarks/bench_router.py --shapes mixtral,qwen3-30b-a3b --layers mixtral,qwen3-30b-a3b
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_layer import time_cuda  # noqa: E402

import uniep_dynamo  # noqa: E402,F401  (registers backend="uniep" when the package is not installed)

# name: (family, config class, router class, block class, config overrides)
SHAPES = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralTopKRouter", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter", "Qwen3MoeSparseMoeBlock",
                      dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           norm_topk_prob=True)),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeTopKRouter", "OlmoeSparseMoeBlock",
              dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8)),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter", "DeepseekV3MoE",
                    dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                         n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)),
    "gpt-oss-20b": ("gpt_oss", "GptOssConfig", "GptOssTopKRouter", "GptOssMLP",
                    dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
}


def build(name, kind, dtype, device, seed=0):
    import transformers

    family, config_name, router_cls, block_cls, overrides = SHAPES[name]
    config = getattr(transformers, config_name)(**overrides)
    config._experts_implementation = "grouped_mm"
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(seed)
    with torch.device(device):
        mod = getattr(module, router_cls if kind == "router" else block_cls)(config)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.02)
        for bname, b in mod.named_buffers():
            if "e_score_correction_bias" in bname:
                b.normal_(0.0, 0.01)
    return mod.to(dtype), config.hidden_size


def compiled(mod, provider):
    torch._dynamo.reset()
    if provider == "eager":
        return mod
    if provider == "inductor":
        return torch.compile(mod, dynamic=False)
    if provider == "uniep":
        return torch.compile(mod, backend="uniep", dynamic=False)
    if provider == "uniep_experts_only":
        return torch.compile(mod, backend="uniep", dynamic=False, options={"rewrite_router": False})
    if provider == "uniep_own_plan":
        return torch.compile(mod, backend="uniep", dynamic=False, options={"share_routing_plan": False})
    raise ValueError(provider)


def time_graph(run, iters, warmup):
    """Median time of one replay of `run` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return time_cuda(graph.replay, iters, warmup)


def bench_router(name, tokens, iters, warmup, dtype, device):
    from torch._dynamo.utils import counters

    router, hidden = build(name, "router", dtype, device)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    row = {"shape": name, "tokens": tokens}
    results = {}
    for provider in ("eager", "inductor", "uniep"):
        counters.clear()
        fn = compiled(router, provider)
        xs = x.clone().requires_grad_()
        g = None

        def fwd():
            with torch.no_grad():
                return fn(x)

        def fwd_bwd():
            nonlocal g
            router.zero_grad(set_to_none=True)
            xs.grad = None
            _logits, weights, _ids = fn(xs)
            if g is None:
                g = torch.randn(weights.shape, device=device, dtype=weights.dtype,
                                generator=torch.Generator(device).manual_seed(1))
            weights.backward(g)
            return weights

        out = fwd()
        results[provider] = out
        row[f"{provider}_fwd_ms"] = round(time_cuda(fwd, iters, warmup), 4)
        row[f"{provider}_fwd_bwd_ms"] = round(time_cuda(fwd_bwd, iters, warmup), 4)
        row[f"{provider}_fwd_graph_ms"] = round(time_graph(fwd, iters, warmup), 4)
        row[f"{provider}_fwd_bwd_graph_ms"] = round(time_graph(fwd_bwd, iters, warmup), 4)
        if provider == "uniep":
            row["uniep_rewrites"] = counters["uniep"]["moe_router"]
            row["uniep_fused_kernel_calls"] = counters["uniep_kernels"]["triton_router"]
    ref_w, ref_ids = results["eager"][1].float(), results["eager"][2]
    got_w, got_ids = results["uniep"][1].float(), results["uniep"][2]
    # DeepSeek's router asks for sorted=False: compare each token's K slots as a set
    ref_sorted, ref_order = ref_ids.sort(dim=-1)
    got_sorted, got_order = got_ids.sort(dim=-1)
    row["uniep_tokens_with_other_ids"] = int((ref_sorted != got_sorted).any(dim=-1).sum())
    same = (ref_sorted == got_sorted).all(dim=-1)
    if same.any():
        diff = (ref_w.gather(1, ref_order) - got_w.gather(1, got_order))[same].abs().max()
        row["uniep_weights_max_rel"] = float(diff / ref_w.abs().max())
    return row


def bench_layer(name, tokens, iters, warmup, dtype, device):
    block, hidden = build(name, "block", dtype, device)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    g = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(2))
    row = {"shape": name, "tokens": tokens}
    for provider in ("inductor", "uniep_experts_only", "uniep_own_plan", "uniep"):
        fn = compiled(block, provider)
        xs = x.clone().requires_grad_()

        def run():
            block.zero_grad(set_to_none=True)
            xs.grad = None
            out = fn(xs)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(g)

        try:
            row[f"{provider}_ms"] = round(time_cuda(run, iters, warmup), 3)
        except Exception as exc:  # noqa: BLE001
            row[f"{provider}_ms"] = "ERR " + repr(exc)[:300]
        torch.cuda.empty_cache()
    return row


def print_rows(title, rows, keys):
    print(title)
    print(f"{'shape':16s} {'T':>6s} " + " ".join(f"{k:>24s}" for k in keys))
    for row in rows:
        print(f"{row['shape']:16s} {row['tokens']:6d} " + " ".join(
            f"{row.get(k):>24}" if not isinstance(row.get(k), float) else f"{row[k]:24.4f}" for k in keys))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b,olmoe,deepseek-v3,gpt-oss-20b")
    parser.add_argument("--tokens", default="8192,128")
    parser.add_argument("--layers", default="mixtral,qwen3-30b-a3b,olmoe")
    parser.add_argument("--layer-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_router.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_router: needs a CUDA GPU")
    import transformers
    import triton

    device, dtype = "cuda", torch.bfloat16
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__}
    print(json.dumps(meta))
    routers, layers = [], []
    for name in filter(None, args.shapes.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            row = bench_router(name, tokens, args.iters, args.warmup, dtype, device)
            print(json.dumps(row), flush=True)
            routers.append(row)
    for name in filter(None, args.layers.split(",")):
        row = bench_layer(name, args.layer_tokens, max(5, args.iters // 2), 3, dtype, device)
        print(json.dumps(row), flush=True)
        layers.append(row)
    if routers:
        for mode in ("fwd", "fwd_bwd"):
            print_rows(f"router {mode}, ms per call (wall) and per CUDA-graph replay (device)", routers,
                       [f"{p}_{mode}{g}_ms" for g in ("", "_graph") for p in ("eager", "inductor", "uniep")])
    if layers:
        print_rows("MoE layer, fwd+bwd (ms)", layers, ["inductor_ms", "uniep_experts_only_ms", "uniep_own_plan_ms",
                                                       "uniep_ms"])
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "router": routers, "layer": layers}, f, indent=1)


if __name__ == "__main__":
    main()
