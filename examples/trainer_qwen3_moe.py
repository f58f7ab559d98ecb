"""A tiny random-weight Hugging Face Qwen3-MoE fine-tuned with HF's Trainer, eager vs uniep, as people train MoE
models: gradient checkpointing, bf16 (on a GPU), AdamW, gradient accumulation.

    python examples/trainer_qwen3_moe.py                  # CPU: fp32
    python examples/trainer_qwen3_moe.py --bf16           # mixed precision (Trainer's bf16=True: autocast)

The model code is HF's and the Trainer set-up is the usual one; the only change is one line:

    model.compile(backend="uniep")

``nn.Module.compile`` compiles the model in place, so the Trainer still sees the model's own class and forward
signature (``torch.compile(model)`` returns a wrapper whose ``forward(*args, **kwargs)`` hides the columns the
Trainer keeps; with it, pass ``remove_unused_columns=False``). Accelerate's ``torch_compile_backend`` argument
takes only the backends it lists, so it cannot name uniep.

Prints the loss curve of both runs side by side (same weights, same batches) and what uniep rewrote.
"""
import argparse
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Trainer, TrainingArguments

import uniep_dynamo  # noqa: F401  (not needed once installed: the backend is an entry point; imported for clarity)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(args):
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
                            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            max_position_embeddings=max(128, args.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def train(args, backend: str | None, options: dict | None = None) -> tuple[list, torch.nn.Module]:
    """The loss per optimizer step of one Trainer run, and the trained model."""
    model = build_model(args)
    if backend is not None:
        model.compile(backend=backend, options=options or {})
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=1e-3, optim="adamw_torch",
        gradient_checkpointing=True, bf16=args.bf16, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        data_seed=0, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    samples = args.batch * args.accumulation * args.steps
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(samples, args.seq, args.vocab))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="Trainer's bf16=True (autocast to bfloat16)")
    parser.add_argument("--output-dir", default="/tmp/uniep-trainer-example")
    args = parser.parse_args()

    start = time.perf_counter()
    eager, _ = train(args, None)
    eager_s = time.perf_counter() - start
    start = time.perf_counter()
    uniep, _ = train(args, "uniep")
    uniep_s = time.perf_counter() - start
    print(f"Qwen3-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-2), batch "
          f"{args.batch}x{args.seq} x {args.accumulation} accumulated, gradient checkpointing, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}")
    print(f"{'step':>4} {'eager loss':>11} {'uniep loss':>11}")
    for step, (a, b) in enumerate(zip(eager, uniep), 1):
        print(f"{step:>4} {a:>11.6f} {b:>11.6f}")
    print(f"wall time (compile included): eager {eager_s:.1f} s, uniep {uniep_s:.1f} s")
    print("uniep rewrites:", dict(counters["uniep"]) or "none")


if __name__ == "__main__":
    main()
