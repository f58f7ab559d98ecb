"""A small random-weight Hugging Face Mixtral trained for a few steps, eager vs torch.compile(backend="uniep").

    python examples/mixtral.py            # CPU: fp32; GPU: bf16
    python examples/mixtral.py --steps 10 --device cuda

Prints the loss of both runs side by side (same weights, same batches), the time per step, and what
uniep rewrote. The model code is HF's, untouched: the only change is the torch.compile line.
"""
import argparse
import copy
import logging
import time

import torch
from transformers import AutoModelForCausalLM, MixtralConfig

import uniep_dynamo  # noqa: F401  (not needed once installed: the backend is an entry point; imported for clarity)
from torch._dynamo.utils import counters


def build(args):
    config = MixtralConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(args.device, args.dtype).train()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)

    rewrites = []
    handler = logging.Handler()
    handler.emit = lambda record: rewrites.append(record.getMessage())
    logging.getLogger("uniep").addHandler(handler)
    logging.getLogger("uniep").setLevel(logging.INFO)

    eager = build(args)
    uniep_model = copy.deepcopy(eager)
    compiled = torch.compile(uniep_model, backend="uniep")
    runs = {"eager": (eager, eager), "uniep": (uniep_model, compiled)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (model, _) in runs.items()}
    gen = torch.Generator().manual_seed(1)
    print(f"Mixtral: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-2), "
          f"batch {args.batch}x{args.seq}, {args.dtype}, {args.device}")
    print(f"{'step':>4} {'eager loss':>11} {'uniep loss':>11} {'eager ms':>9} {'uniep ms':>9}")
    for step in range(args.steps):
        ids = torch.randint(0, 1024, (args.batch, args.seq), generator=gen).to(args.device)
        row = {}
        for name, (model, run) in runs.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if args.device == "cuda":
                torch.cuda.synchronize()
            row[name] = (loss.item(), (time.perf_counter() - start) * 1e3)
        note = "  (first step compiles)" if step == 0 else ""
        print(f"{step:>4} {row['eager'][0]:>11.5f} {row['uniep'][0]:>11.5f} {row['eager'][1]:>9.1f} "
              f"{row['uniep'][1]:>9.1f}{note}")
    print(f"\nrewrites: {dict(counters['uniep'])}")
    for line in rewrites:
        print(" ", line)


if __name__ == "__main__":
    main()
