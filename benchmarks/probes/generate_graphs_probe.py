"""Does generate() run with the model's forward compiled under mode="reduce-overhead" and an HF StaticCache (the
user's own compile; generate()'s is off, ``disable_compile=True``)? A tiny bf16 model of tests/hf_models.py, three
generate() calls of 6 tokens, each with a new static cache; prints the tokens of each call. Run it once per variant
in its own process (a crash ends it):

    python benchmarks/probes/generate_graphs_probe.py BACKEND VARIANT    # BACKEND: uniep or inductor
    VARIANT: base; nopartition (torch._inductor.config.graph_partition = False); dynamic (no static cache)

2026-11-29 (twenty-third session, one H200, torch 2.11): see BENCHMARKS.md.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import uniep_dynamo  # noqa: E402,F401
from hf_models import build_model  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import StaticCache  # noqa: E402

backend, variant = sys.argv[1], sys.argv[2]
if variant == "nopartition":
    torch._inductor.config.graph_partition = False
model = build_model(os.environ.get("FAM", "qwen3_moe"), dtype=torch.bfloat16).cuda().eval()
model.forward = torch.compile(model.forward, backend=backend, mode="reduce-overhead")
ids = torch.randint(0, 96, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, disable_compile=True)
with torch.no_grad():
    for i in range(3):
        cache = StaticCache(config=model.config, max_cache_len=32) if variant != "dynamic" else None
        out = model.generate(ids, past_key_values=cache, **kw) if cache is not None else model.generate(ids, **kw)
        torch.cuda.synchronize()
        print(backend, variant, "run", i, out[0, -6:].tolist(), flush=True)
print("OK", backend, variant, dict(counters["uniep"]), dict(counters["inductor"]).get("cudagraph_skips"), flush=True)
