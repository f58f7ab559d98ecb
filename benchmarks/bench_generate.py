"""Inference end to end: generate() of an HF MoE model at real dimensions (random weights, a few decoder layers),
eager, compiled by inductor and compiled by uniep, in the same run on the same model.

Greedy decoding of --new-tokens tokens after a --prompt-tokens prompt, --batch sequences, bf16, an HF static cache
(``StaticCache``: each decode step has the same shapes, so a compiled forward is traced once for the decode steps,
and once for the prefill where that is compiled too). Two ways to compile, as HF's docs show them:

- ``--compile forward`` (default): ``model.forward = torch.compile(model.forward, ...)``, the default mode or
  ``mode="reduce-overhead"`` (CUDA graphs) where ``--graphs`` is given; generate() gets ``disable_compile=True``.
  Without it HF compiles ``__call__`` again for the decode steps whenever the cache is a static one on a GPU (by
  inductor, "reduce-overhead"), around the user's compiled forward. The twenty-second session's runs left that on:
  an "eager" row would have decoded through inductor, and the compiled rows ran inside that second compile.
- ``--compile hf``: generate()'s own compilation, ``compile_config=CompileConfig(backend=...)``: HF compiles the decode
  steps' ``__call__`` (``--graphs``: mode "reduce-overhead", HF's default; without it the default mode) and runs the
  prefill eager, so the compiled rows' prefill is eager's.

Per backend: the prefill's time (generate() of one token), the whole generate()'s, the decode step's (the
difference over the remaining tokens), tokens a second, and how many of the generated tokens equal eager's where
``eager`` comes first in --backends (in bf16 a near-tie may fork a sequence; the tokens after a fork see other
prefixes). Each backend runs in a process of its own (a crash, such as the twenty-third session's under
``--graphs``, then ends its row only; ``--in-process`` runs them all in this one).

    python benchmarks/bench_generate.py --model qwen3-30b-a3b --layers 4 --batch 8 --prompt-tokens 256 \
        --new-tokens 64 [--graphs] [--compile hf]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_train_step import MODELS, build  # noqa: E402


def timed_generate(model, input_ids, new_tokens: int, iters: int, cache_len: int, compile_kwargs: dict):
    """(median seconds of generate() over ``iters`` runs after one untimed, its output sequences). Each run gets a
    new static cache of ``cache_len`` positions, made before its clock starts: the prefill-only runs and the whole
    ones see the same cache shapes, so the compiled forward is not traced again for them."""
    from transformers import StaticCache

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  **compile_kwargs)

    def generate():
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids, past_key_values=cache, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    with torch.no_grad():
        generate()  # traces and compiles (and records the CUDA graphs) where asked
        runs = [generate() for _ in range(iters)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def run_backend(args, backend: str, input_ids, eager_tokens) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(args.model, args.layers, args.prompt_tokens + args.new_tokens, torch.bfloat16).eval()
    compile_kwargs = {"disable_compile": True}
    if backend != "eager" and args.compile == "forward":
        options = {"mode": "reduce-overhead"} if args.graphs else {}
        model.forward = torch.compile(model.forward, backend=backend, **options)
    elif backend != "eager":
        from transformers import CompileConfig

        compile_kwargs = {"compile_config": CompileConfig(backend=backend,
                                                          mode="reduce-overhead" if args.graphs else "default")}
    t0 = time.time()
    cache_len = args.prompt_tokens + args.new_tokens
    prefill_s, _ = timed_generate(model, input_ids, 1, args.iters, cache_len, compile_kwargs)
    total_s, out = timed_generate(model, input_ids, args.new_tokens, args.iters, cache_len, compile_kwargs)
    row = {"backend": backend, "first_calls_s": round(time.time() - t0, 1),
           "prefill_ms": round(prefill_s * 1e3, 3), "generate_ms": round(total_s * 1e3, 3),
           "decode_step_ms": round((total_s - prefill_s) / (args.new_tokens - 1) * 1e3, 3),
           "tokens_per_s": round(args.batch * args.new_tokens / total_s, 1)}
    new = out[:, input_ids.shape[1]:]
    if eager_tokens is not None:
        row["tokens_equal_to_eager"] = f"{int((new == eager_tokens).sum())}/{new.numel()}"
    if backend == "uniep":
        row["rewrites"] = {k: v for k, v in counters["uniep"].items() if k in ("moe_experts", "moe_router")}
        row["kernels"] = dict(counters["uniep_kernels"])
    del model
    torch.cuda.empty_cache()
    return row, new


def run_child(backend: str, work: str):
    """(row, generated tokens or None) of ``backend`` run by this script in a process of its own (the same arguments,
    that one backend); a process that dies (a signal) or fails gives a row with the error."""
    folder = os.path.join(work, backend)
    os.makedirs(folder, exist_ok=True)
    code = subprocess.call([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--backends", backend,
                            "--child", folder])
    if code == 0 and os.path.exists(os.path.join(folder, "row.json")):
        with open(os.path.join(folder, "row.json")) as f:
            return json.load(f), torch.load(os.path.join(folder, "tokens.pt")).cuda()
    try:
        why = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
    except ValueError:
        why = f"signal {-code}"
    return {"backend": backend, "error": f"its process ended with {why}"}, None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--graphs", action="store_true", help='compile with mode="reduce-overhead" (CUDA graphs)')
    parser.add_argument("--compile", choices=("forward", "hf"), default="forward",
                        help="forward: model.forward compiled by the user; hf: generate()'s compile_config")
    parser.add_argument("--backends", default="eager,inductor,uniep")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_generate.json"))
    parser.add_argument("--in-process", action="store_true", help="every backend in this process (a crash ends all)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # a folder: run one backend, leave its row there
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_generate: needs a CUDA GPU")
    if args.new_tokens < 2:
        sys.exit("bench_generate: --new-tokens >= 2 (the decode step is timed from the difference with one token)")
    import transformers

    import uniep_dynamo  # noqa: F401  (registers the backend)

    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": transformers.__version__,
            **{k: v for k, v in vars(args).items() if k != "out"}}
    if not args.child:
        print(json.dumps(meta), flush=True)
    vocab = MODELS[args.model][1]["vocab_size"]
    input_ids = torch.randint(0, vocab, (args.batch, args.prompt_tokens), device="cuda",
                              generator=torch.Generator("cuda").manual_seed(0))
    if args.child:  # one backend, in the process the parent started: its row and tokens into the folder given
        eager_path = os.path.join(args.child, "..", "eager_tokens.pt")
        eager_tokens = torch.load(eager_path).cuda() if os.path.exists(eager_path) else None
        row, tokens = run_backend(args, args.backends, input_ids, eager_tokens)
        torch.save(tokens.cpu(), os.path.join(args.child, "tokens.pt"))
        with open(os.path.join(args.child, "row.json"), "w") as f:
            json.dump(row, f)
        return
    rows, eager_tokens, work = [], None, tempfile.mkdtemp(prefix="bench_generate_")
    for backend in args.backends.split(","):
        print(f"# {time.strftime('%H:%M:%S')} {backend}", flush=True)
        if args.in_process:
            try:
                row, tokens = run_backend(args, backend, input_ids, eager_tokens)
            except Exception as exc:  # noqa: BLE001
                row, tokens = {"backend": backend, "error": repr(exc)[:400]}, None
        else:
            row, tokens = run_child(backend, work)
        if backend == "eager":
            eager_tokens = tokens
            if tokens is not None:
                torch.save(tokens.cpu(), os.path.join(work, "eager_tokens.pt"))
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'backend':10s} {'prefill ms':>11s} {'decode step ms':>15s} {'generate ms':>12s} {'tokens/s':>10s}")
    for row in rows:
        if "error" in row:
            print(f"{row['backend']:10s} ERR {row['error'][:100]}")
        else:
            print(f"{row['backend']:10s} {row['prefill_ms']:11.3f} {row['decode_step_ms']:15.3f} "
                  f"{row['generate_ms']:12.3f} {row['tokens_per_s']:10.1f}")


if __name__ == "__main__":
    main()
