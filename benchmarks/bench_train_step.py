"""End to end: one training step of a 2-layer HF MoE model at real dimensions (random weights): Mixtral-8x7B's
(default), Qwen3-30B-A3B's or OLMoE's.

Batch 2 x 4096 tokens, bf16, forward + backward + AdamW, the whole model under
torch.compile(backend="inductor") and torch.compile(backend="uniep"), timed in the same run on the
same model (dynamo is reset between backends). Prints a table and writes JSON.

    python benchmarks/bench_train_step.py --out train_step.json
    python benchmarks/bench_train_step.py --model qwen3-30b-a3b --checkpointing   # HF gradient checkpointing on
    python benchmarks/bench_train_step.py --checkpointing --backends inductor,inductor_traced_checkpoint,uniep

--time-experts: after timing uniep, one more step with CUDA events around the experts ops' work: their GPU time
against the whole step's (what a faster experts layer could take off the step).

--breakdown: after timing each backend, one more step with CUDA events between its forward (with the loss),
backward and optimizer step, and one under torch.profiler: the GPU time of each phase and the kernels that took the
most time (summed by name), where the step's time goes outside the experts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_layer import time_cuda  # noqa: E402


MODELS = {  # name: (config class, its MoE dimensions and attention; 2 layers unless --layers)
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                      num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                                      vocab_size=32000)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, vocab_size=151936)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                                  num_attention_heads=16, num_key_value_heads=16, vocab_size=50304)),
}


def build(name: str, layers: int, seq: int, dtype):
    import transformers

    config_name, dims = MODELS[name]
    cfg = getattr(transformers, config_name)(num_hidden_layers=layers, max_position_embeddings=seq, **dims)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    return model


def experts_share(step) -> dict:
    """One more step, with CUDA events around each call of the MegaKernel's experts forward, backward and input-row
    combine (the uniep experts ops' work; ops.py calls them through the megakernel module): the GPU time from each
    call's first work to its last, summed, against the whole step's."""
    from uniep_dynamo.kernels import megakernel

    spans = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            spans.append((start, end))
            return out
        return wrapper

    names = ("experts_forward", "experts_backward", "combine_input_rows")
    saved = {n: getattr(megakernel, n) for n in names}
    try:
        for n in names:
            setattr(megakernel, n, timed(saved[n]))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    finally:
        for n in names:
            setattr(megakernel, n, saved[n])
    return {"experts_calls": len(spans), "experts_ms": round(sum(s.elapsed_time(e) for s, e in spans), 2),
            "events_step_ms": round(start.elapsed_time(end), 2)}


def breakdown(forward, backward, optimizer, top: int = 12) -> dict:
    """One step timed phase by phase with CUDA events (forward with the loss, backward, optimizer step), then one
    under torch.profiler: each phase's ms and the ``top`` kernels by summed GPU time."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    events[0].record()
    loss = forward()
    events[1].record()
    backward(loss)
    events[2].record()
    optimizer()
    events[3].record()
    torch.cuda.synchronize()
    phases = {name: round(events[i].elapsed_time(events[i + 1]), 2)
              for i, name in enumerate(("forward_ms", "backward_ms", "optimizer_ms"))}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        backward(forward())
        optimizer()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:90]
            kernels[name] = kernels.get(name, 0.0) + event.time_range.elapsed_us() / 1000
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    return {**phases, "kernels_ms": round(sum(kernels.values()), 2),
            "top_kernels": [[name, round(ms, 3)] for name, ms in ranked[:top]]}


# "inductor_traced_checkpoint": inductor with torch's own skip_fwd_side_effects_in_bwd_under_checkpoint on (process-wide,
# for that row only), as accelerate's regional compile sets it: the checkpointed layers' side effects (transformers 5.25's
# kernels context variable) traced, as uniep traces them in its own compiles (uniep_dynamo/checkpoint_effects.py)
BACKENDS = {"inductor": ("inductor", False), "uniep": ("uniep", False), "inductor_traced_checkpoint": ("inductor", True)}


def time_backend(model, name, input_ids, iters, warmup, time_experts=False, phases=False):
    from torch._dynamo.utils import counters

    backend, traced_checkpoint = BACKENDS[name]
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=traced_checkpoint):
        return _time_backend(model, backend, input_ids, iters, warmup, time_experts, phases, counters)


def _time_backend(model, backend, input_ids, iters, warmup, time_experts, phases, counters):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def forward():
        return compiled(input_ids=input_ids, labels=input_ids).loss

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        loss = forward()
        loss.backward()
        optimizer()
        return loss

    t0 = time.time()
    first_loss = step().item()
    compile_s = time.time() - t0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_cuda(step, iters, warmup)
    row = {"ms": round(ms, 2), "first_step_s": round(compile_s, 1), "first_loss": round(first_loss, 4),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "uniep_rewrites": counters["uniep"]["moe_experts"], "uniep_router_rewrites": counters["uniep"]["moe_router"],
           "graph_breaks": sum(counters["graph_break"].values())}
    if time_experts and backend == "uniep":
        row.update(experts_share(step))
    if phases:
        row.update(breakdown(forward, lambda loss: loss.backward(), optimizer))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixtral", choices=sorted(MODELS))
    parser.add_argument("--checkpointing", action="store_true",
                        help="HF gradient checkpointing on (non-reentrant torch.utils.checkpoint per layer)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backends", default="inductor,uniep", help=f"comma-separated, of {sorted(BACKENDS)}")
    parser.add_argument("--time-experts", action="store_true",
                        help="one more uniep step: GPU time of the experts ops' work against the whole step's")
    parser.add_argument("--breakdown", action="store_true",
                        help="one more step per backend: its forward, backward and optimizer time, and its top kernels")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_train_step.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train_step: needs a CUDA GPU")
    import uniep_dynamo  # noqa: F401

    model = build(args.model, args.layers, args.seq, torch.bfloat16)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(0))
    import transformers

    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": args.model,
            "checkpointing": args.checkpointing, "layers": args.layers,
            "batch": args.batch, "seq": args.seq}
    rows = {}
    for backend in args.backends.split(","):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rows[backend] = time_backend(model, backend, input_ids, args.iters, args.warmup, args.time_experts,
                                     args.breakdown)
        model.load_state_dict(state)  # every backend starts from the same weights
        del state
        print(json.dumps({backend: rows[backend]}), flush=True)
    base = rows.get("inductor", {}).get("ms")
    print(f"{'backend':10s} {'step ms':>10s} {'speedup':>8s} {'peak GB':>8s} {'first loss':>10s}")
    for backend, row in rows.items():
        speed = f"{base / row['ms']:.3f}x" if base else "-"
        print(f"{backend:10s} {row['ms']:10.2f} {speed:>8s} {row['peak_gb']:8.2f} {row['first_loss']:10.4f}")
    for backend, row in rows.items():
        if "top_kernels" in row:
            print(f"{backend}: forward {row['forward_ms']} ms, backward {row['backward_ms']} ms, optimizer "
                  f"{row['optimizer_ms']} ms; kernels {row['kernels_ms']} ms, the most:")
            for name, ms in row["top_kernels"]:
                print(f"  {ms:9.3f}  {name}")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
