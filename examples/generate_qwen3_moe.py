"""Greedy generate() of a small random-weight Hugging Face Qwen3-MoE, eager and with generate()'s own compilation by
uniep: a static cache and ``compile_config=CompileConfig(backend="uniep")``, as HF documents compiled decoding.

    python examples/generate_qwen3_moe.py                 # CPU: fp32, the default mode
    python examples/generate_qwen3_moe.py --device cuda   # GPU: bf16, HF's default mode "reduce-overhead" (CUDA graphs)

HF compiles the decode steps' forward (the prefill runs eager) and uniep rewrites each decoder layer's router and
experts in it. Prints both runs' tokens, how many agree (on a CPU in fp32, 24 of 24; in bf16 a near-tie may fork a
sequence), each generate()'s time (the first compiled call traces and compiles, so the compiled one runs twice and
the second is timed), and what uniep rewrote. On a CPU HF compiles only when asked to (``_compile_all_devices``),
and this example asks.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, CompileConfig, Qwen3MoeConfig

import uniep_dynamo  # noqa: F401  (not needed once installed: the backend is an entry point; imported for clarity)
from torch._dynamo.utils import counters


def build(args):
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_experts=args.experts, num_experts_per_tok=2,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(args.device, args.dtype).eval()


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    model = build(args)
    ids = torch.randint(0, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    # HF's default mode is "reduce-overhead" (CUDA graphs); on a CPU there are none, so the default mode there
    compile_config = CompileConfig(backend="uniep", **({} if args.device == "cuda" else {"mode": "default"}))
    if args.device != "cuda":
        compile_config._compile_all_devices = True
    with torch.no_grad():
        eager, eager_s = timed(lambda: model.generate(ids, disable_compile=True, **kwargs))
        timed(lambda: model.generate(ids, compile_config=compile_config, **kwargs))  # traces and compiles
        compiled, compiled_s = timed(lambda: model.generate(ids, compile_config=compile_config, **kwargs))
    new = slice(args.prompt, None)
    same = int((compiled[:, new] == eager[:, new]).sum())
    print(f"eager tokens: {eager[0, new].tolist()}")
    print(f"uniep tokens: {compiled[0, new].tolist()}")
    print(f"{same}/{compiled[:, new].numel()} generated tokens equal eager's; "
          f"generate() {eager_s * 1e3:.1f} ms eager, {compiled_s * 1e3:.1f} ms compiled ({args.device}, {args.dtype})")
    print(f"uniep rewrote: {dict(counters['uniep'])}")


if __name__ == "__main__":
    main()
