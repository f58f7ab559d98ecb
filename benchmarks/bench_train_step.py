"""End to end: one training step of a 2-layer HF Mixtral with Mixtral-8x7B dimensions (random weights).

Batch 2 x 4096 tokens, bf16, forward + backward + AdamW, the whole model under
torch.compile(backend="inductor") and torch.compile(backend="uniep"), timed in the same run on the
same model (dynamo is reset between backends). Prints a table and writes JSON.

    python benchmarks/bench_train_step.py --out train_step.json

--profile-experts: after timing uniep, one profiled step: the GPU time of the kernels launched inside the uniep
experts ops (forward, backward) against the rest of the step's kernels.
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


def build(layers: int, seq: int, dtype):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                        max_position_embeddings=seq)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = MixtralForCausalLM(cfg).to(dtype)
    return model


EXPERTS_OPS = ("uniep::moe_experts", "uniep::moe_experts_backward", "uniep::moe_experts_backward_",
               "uniep::moe_experts_backward_combine")


def experts_share(step) -> dict:
    """One profiled step: ms of GPU kernels under the uniep experts ops (outermost calls only) and in all."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    experts_us = calls = 0
    for e in events:
        if e.name in EXPERTS_OPS and not _has_ancestor(e, EXPERTS_OPS):
            experts_us += e.device_time_total
            calls += 1
    kernels_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"experts_op_calls": calls, "experts_kernels_ms": round(experts_us / 1e3, 2),
            "all_kernels_ms": round(kernels_us / 1e3, 2)}


def _has_ancestor(event, names) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def time_backend(model, backend, input_ids, iters, warmup, profile_experts=False):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step():
        loss = compiled(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    first_loss = step().item()
    compile_s = time.time() - t0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_cuda(step, iters, warmup)
    row = {"ms": round(ms, 2), "first_step_s": round(compile_s, 1), "first_loss": round(first_loss, 4),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "uniep_rewrites": counters["uniep"]["moe_experts"]}
    if profile_experts and backend == "uniep":
        row.update(experts_share(step))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backends", default="inductor,uniep")
    parser.add_argument("--profile-experts", action="store_true",
                        help="profile one uniep step: GPU time inside the experts ops against the whole step's")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_train_step.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train_step: needs a CUDA GPU")
    import uniep_dynamo  # noqa: F401

    model = build(args.layers, args.seq, torch.bfloat16)
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(0))
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
            "batch": args.batch, "seq": args.seq}
    rows = {}
    for backend in args.backends.split(","):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rows[backend] = time_backend(model, backend, input_ids, args.iters, args.warmup, args.profile_experts)
        model.load_state_dict(state)  # every backend starts from the same weights
        del state
        print(json.dumps({backend: rows[backend]}), flush=True)
    base = rows.get("inductor", {}).get("ms")
    print(f"{'backend':10s} {'step ms':>10s} {'speedup':>8s} {'peak GB':>8s} {'first loss':>10s}")
    for backend, row in rows.items():
        speed = f"{base / row['ms']:.3f}x" if base else "-"
        print(f"{backend:10s} {row['ms']:10.2f} {speed:>8s} {row['peak_gb']:8.2f} {row['first_loss']:10.4f}")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
