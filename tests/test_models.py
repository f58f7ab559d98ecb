"""Layer 3b: whole tiny HF models of the named families, compiled end to end."""
import pytest
import torch
from torch._dynamo.utils import counters

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_models import FAMILIES, build_model, moe_layer_count


def loss_and_grads(model, input_ids, run=None):
    """Loss, logits and parameter gradients of `run` (the model itself, or a compiled wrapper of it)."""
    model.zero_grad(set_to_none=True)
    out = (run if run is not None else model)(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_model_matches_eager_under_inductor(family):
    model = build_model(family)
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, logits, grads = loss_and_grads(model, input_ids)
    compiled = torch.compile(model, backend="uniep")
    c_loss, c_logits, c_grads = loss_and_grads(model, input_ids, compiled)
    assert counters["uniep"]["moe_experts"] == moe_layer_count(model) == 2
    # the rewrite count per layer covers the router too: one moe_router and one moe_experts per layer
    assert counters["uniep"]["moe_router"] == 2 and counters["uniep"]["router_unfused"] == 0
    assert max_rel_err(c_loss, loss) <= TOLERANCE[torch.float32]
    assert max_rel_err(c_logits, logits) <= TOLERANCE[torch.float32]
    assert c_grads.keys() == grads.keys()
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name  # inductor reorders reductions elsewhere


def compiled_like_eager_without_weight_gradient_gemms(model, monkeypatch, weight_gradients=False) -> dict:
    """One step of ``model`` eager and compiled by uniep (both MoE layers rewritten): the same loss and gradients
    (returned, eager's), and no weight-gradient GEMM in the compiled step (a spy on the fused backward's), or, with
    ``weight_gradients``, some."""
    from uniep_dynamo.kernels import megakernel

    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, _, grads = loss_and_grads(model, input_ids)
    calls = []
    inner = megakernel.weight_grad
    monkeypatch.setattr(megakernel, "weight_grad", lambda *a, **k: calls.append(1) or inner(*a, **k))
    counters.clear()
    c_loss, _, c_grads = loss_and_grads(model, input_ids, torch.compile(model, backend="uniep"))
    assert counters["uniep"]["moe_experts"] == 2
    assert bool(calls) == weight_gradients
    assert c_grads.keys() == grads.keys()
    assert max_rel_err(c_loss, loss) <= TOLERANCE[torch.float32]
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name
    return grads


def test_frozen_experts_match_eager_and_skip_their_weight_gradients(monkeypatch):
    """LoRA-style fine-tuning: the experts frozen (their weights need no gradient), the rest trainable. The compiled
    model's loss and every gradient match eager's, the experts get none, and the fused backward (the Triton kernels in
    the interpreter) runs no weight-gradient GEMM. (The op's reference path: tests/test_megakernel.py.)"""
    pytest.importorskip("triton", reason="triton is not installed")
    from uniep_dynamo.kernels import config as kconfig
    if not kconfig.interpreting():
        pytest.skip("the fused kernels run here in Triton's interpreter (TRITON_INTERPRET=1, set by conftest without "
                    "a GPU); on a GPU, tests/test_gpu_megakernel.py covers frozen experts")
    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    model = build_model("qwen3_moe")
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    grads = compiled_like_eager_without_weight_gradient_gemms(model, monkeypatch)
    assert not any(".experts." in name for name in grads)


def test_peft_lora_on_every_linear_layer(monkeypatch):
    """LoRA through PEFT on every linear layer (``target_modules="all-linear"``), the way MoE models are most often
    fine-tuned. PEFT 0.18 leaves the experts and the router HF's frozen modules: uniep rewrites both in each
    layer with no expert weight-gradient GEMM. Newer PEFT puts LoRA on their parameters too (a parametrization that
    adds each expert's low-rank delta in the forward): uniep rewrites both over the computed weights, and the
    weight-gradient GEMMs feed the LoRA factors. Either way the compiled model's loss and LoRA gradients match
    eager's (interpreter)."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")
    from uniep_dynamo.kernels import config as kconfig

    if kconfig.interpreting():
        monkeypatch.setenv("UNIEP_KERNELS", "triton")
    model = peft.get_peft_model(build_model("qwen3_moe"), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                            target_modules="all-linear"))
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".mlp." in n and "lora_" not in n)
    on_experts = any(".experts." in n and "lora_B" in n for n, _ in model.named_parameters())
    if on_experts:  # PEFT initializes B to zero: a delta of zero would not tell the LoRA path from the base weight
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp." in name and "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    grads = compiled_like_eager_without_weight_gradient_gemms(model, monkeypatch, weight_gradients=on_experts)
    assert counters["uniep"]["moe_router"] == 2
    assert all("lora_" in name for name in grads)
    assert not on_experts or any(".experts." in name for name in grads)


def test_two_compiled_training_runs_are_bitwise_equal():
    model = build_model("mixtral")
    input_ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="uniep")
    first = loss_and_grads(model, input_ids, compiled)
    second = loss_and_grads(model, input_ids, compiled)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_whole_model_dynamic_sequence_lengths(family, caplog):
    """dynamic=True: GPT-OSS's float config scalars (clamp limit, alpha) become graph inputs read with
    .item(); they travel into the op as 0-d operands. Loss and every gradient match eager."""
    model = build_model(family)
    compiled = torch.compile(model, backend="uniep", options={"inner_backend": "eager"}, dynamic=True)
    for seq in (5, 9, 17):
        ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
        loss, logits, grads = loss_and_grads(model, ids)
        c_loss, c_logits, c_grads = loss_and_grads(model, ids, compiled)
        assert max_rel_err(c_logits, logits) <= TOLERANCE[torch.float32]
        for name in grads:
            assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name
    assert counters["uniep"]["moe_experts"] >= 2
    assert counters["uniep"]["unfused"] == 0, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_whole_model_batched_mm_and_inference(family):
    model = build_model(family, implementation="batched_mm")
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend="uniep", options={"inner_backend": "eager"})
    with torch.no_grad():
        assert max_rel_err(compiled(input_ids=ids).logits, model(input_ids=ids).logits) <= TOLERANCE[torch.float32]
    assert counters["uniep"]["moe_experts"] == 2


from hf_families import break_router_ties, build_causal_lm, discover_experts_classes  # noqa: E402

DISCOVERED = discover_experts_classes()
# Families whose every router the router pattern rewrites (measured with transformers 5.23); the others
# (DeepSeek-V4's hash routing, PhiMoE's sparsemixer, ...) keep their router in the inner backend.
ROUTER_FAMILIES = {"afmoe", "aria", "cohere2_moe", "exaone_moe", "glm4_moe", "gpt_oss", "granitemoe", "granitemoe_swa",
                   "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "inkling2", "laguna", "mellum", "mimo_v2_flash",
                   "minimax", "minimax_m2", "minimax_m3_vl", "mixtral", "nemotron_h", "olmoe", "qwen2_moe", "qwen3_moe",
                   "solar_open"}


@pytest.mark.parametrize("family, cls", DISCOVERED, ids=[c.__name__ for _, c in DISCOVERED])
def test_every_family_whole_model_rewrites_each_moe_layer(family, cls):
    """Whole tiny models of every discovered family whose config shrinks generically: one rewrite per
    experts module, logits equal to eager."""
    try:
        model = break_router_ties(build_causal_lm(cls))
        ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            eager = model(input_ids=ids).logits
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{family}: its default config does not shrink to a tiny causal LM generically ({exc!r:.120}); "
                    "its experts are covered block-level in test_hf_families")
    layers = sum(1 for m in model.modules() if type(m) is cls)
    if layers == 0:
        pytest.skip(f"{family}: the shrunk default config has no {cls.__name__} layer (dense layers only)")
    with torch.no_grad():
        out = torch.compile(model, backend="uniep", options={"inner_backend": "eager"})(input_ids=ids).logits
    assert counters["uniep"]["moe_experts"] == layers
    assert counters["uniep"]["moe_router"] == layers if family in ROUTER_FAMILIES else \
        counters["uniep"]["moe_router"] <= layers
    assert max_rel_err(out, eager) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_feed_the_load_balancing_loss(family):
    """output_router_logits=True: the aux loss reads every layer's router logits (an output of the router
    op) and ranks them again with its own top-k, which is not a router and is not reported as one. (The
    rewrite is the point: aot_eager behind it; test_whole_model_matches_eager_under_inductor has inductor.)"""
    model = build_model(family)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.1
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, _logits, grads = loss_and_grads(model, input_ids)
    compiled = torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})
    c_loss, _c_logits, c_grads = loss_and_grads(model, input_ids, compiled)
    assert counters["uniep"]["moe_router"] == 2 and counters["uniep"]["router_unfused"] == 0
    assert max_rel_err(c_loss, loss) <= TOLERANCE[torch.float32]
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name


@pytest.mark.parametrize("family,implementation,spelling", [("qwen3_moe", "grouped_mm", "model.compile"),
                                                             ("mixtral", "batched_mm", "forward")])
def test_generate_with_a_compiled_model_matches_eager(family, implementation, spelling):
    """generate() as users speed it up: the module compiled in place (``model.compile(backend="uniep")``) or its forward
    (``model.forward = torch.compile(model.forward, ...)``). Greedy decoding with the KV cache gives eager's tokens and,
    step by step, its scores; the prefill graph and the decode graphs (one token a sequence; recompiled with a dynamic
    cache length) each run both layers' router and experts ops."""
    model = build_model(family, implementation=implementation).eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    options = {"inner_backend": "eager"}
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        if spelling == "model.compile":
            model.compile(backend="uniep", options=options)
        else:
            model.forward = torch.compile(model.forward, backend="uniep", options=options)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert max_rel_err(a, b) <= TOLERANCE[torch.float32], step
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2, graphs  # the prefill and at least one decode graph
    assert counters["uniep"]["moe_experts"] == counters["uniep"]["moe_router"] == 2 * graphs
    assert counters["uniep"]["unfused"] == 0


def test_generate_under_inference_mode_with_beam_search_matches_eager():
    """generate() inside ``torch.inference_mode()`` (inference tensors, not only no_grad) with beam search (the cache
    reordered between steps), the forward compiled: eager's sequences, the router and experts ops in every graph."""
    model = build_model("qwen3_moe").eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, num_beams=3)
    with torch.inference_mode():
        want = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, backend="uniep", options={"inner_backend": "eager"})
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2 and counters["uniep"]["moe_experts"] == counters["uniep"]["moe_router"] == 2 * graphs
    assert counters["uniep"]["unfused"] == 0


@pytest.mark.parametrize("family,implementation", [("qwen3_moe", "grouped_mm"), ("mixtral", "batched_mm"),
                                                   ("gpt_oss", "grouped_mm")])
def test_generate_with_hf_compile_config_matches_eager(family, implementation):
    """generate()'s own compilation (a static cache and ``compile_config=CompileConfig(backend="uniep")``): HF
    compiles the decode steps' forward (its prefill runs eager); the decode graph runs both layers' router and experts
    ops and greedy decoding gives eager's tokens and scores. HF compiles only on GPUs unless ``_compile_all_devices``;
    the GPU case (test_gpu.py) runs HF's default mode, "reduce-overhead"."""
    from transformers import CompileConfig

    model = build_model(family, implementation=implementation).eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                  cache_implementation="static")
    compile_config = CompileConfig(backend="uniep", mode=None, options={"inner_backend": "eager"})
    compile_config._compile_all_devices = True
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        got = model.generate(ids, compile_config=compile_config, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert max_rel_err(a, b) <= TOLERANCE[torch.float32], step
    # the decode step's graph; GPT-OSS's again once (its sliding-window cache's length, an int, changes)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2
    assert counters["uniep"]["moe_experts"] == counters["uniep"]["moe_router"] == 2 * graphs
    assert counters["uniep"]["unfused"] == 0
