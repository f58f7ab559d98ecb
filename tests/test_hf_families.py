"""Layer 3a: every HF experts class decorated with @use_experts_implementation, block alone.

The classes are discovered from the installed transformers, not listed. Each is built tiny with
random weights, compiled with backend="uniep", and must rewrite once and match eager in the output
and every gradient (a post-expert norm's weight included).
"""
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_families import build_experts, discover_experts_classes, routed_inputs

FAMILIES = discover_experts_classes()
NAMED = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts", "DeepseekV3Experts", "GptOssExperts")


def test_discovery_finds_the_decorated_families():
    names = {cls.__name__ for _, cls in FAMILIES}
    assert set(NAMED) <= names
    assert len(FAMILIES) >= 40, f"only {len(FAMILIES)} decorated experts classes found"


def run_case(cls, implementation, dtype, train=True, tokens=7, inner="eager", dynamic=None, caplog=None):
    experts = build_experts(cls, implementation, dtype)
    compiled = torch.compile(experts, backend="uniep", options={"inner_backend": inner}, dynamic=dynamic)
    params = list(experts.parameters())
    x, ids, w = routed_inputs(experts, tokens=tokens, dtype=dtype, requires_grad=train)
    if not train:
        with torch.no_grad():
            assert max_rel_err(compiled(x, ids, w), experts(x, ids, w)) <= TOLERANCE[dtype]
        return experts
    eager = experts(x, ids, w)
    eager_grads = torch.autograd.grad(eager.float().sum(), [x, w] + params)
    out = compiled(x, ids, w)
    grads = torch.autograd.grad(out.float().sum(), [x, w] + params)
    assert out.dtype == eager.dtype
    assert max_rel_err(out, eager) <= TOLERANCE[dtype]
    for name, got, want in zip(["hidden", "weights"] + [n for n, _ in experts.named_parameters()], grads, eager_grads):
        assert max_rel_err(got, want) <= TOLERANCE[dtype], f"gradient of {name}"
    return experts


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family, cls", FAMILIES, ids=[c.__name__ for _, c in FAMILIES])
def test_every_family_rewrites_and_matches_eager_fp32(family, cls, implementation, caplog):
    with caplog.at_level(logging.WARNING, logger="uniep"):
        run_case(cls, implementation, torch.float32)
    assert counters["uniep"]["moe_experts"] == 1, [r.getMessage() for r in caplog.records]


NAMED_CLASSES = [(f, c) for f, c in FAMILIES if c.__name__ in NAMED]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family, cls", NAMED_CLASSES, ids=[c.__name__ for _, c in NAMED_CLASSES])
def test_named_families_half_precision(family, cls, implementation, dtype):
    """bf16 compiles to the torch.nn.functional.grouped_mm spelling, fp16 to transformers' fallback op."""
    run_case(cls, implementation, dtype)
    assert counters["uniep"]["moe_experts"] == 1


@pytest.mark.parametrize("family, cls", NAMED_CLASSES, ids=[c.__name__ for _, c in NAMED_CLASSES])
def test_named_families_inference_no_grad(family, cls):
    run_case(cls, "grouped_mm", torch.float32, train=False)
    assert counters["uniep"]["moe_experts"] == 1


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_dynamic_shapes_and_varying_token_counts(implementation):
    """One dynamic graph serves several token counts, including a single token."""
    cls = dict((c.__name__, c) for _, c in FAMILIES)["Qwen3MoeExperts"]
    experts = build_experts(cls, implementation, torch.float32)
    compiled = torch.compile(experts, backend="uniep", options={"inner_backend": "eager"}, dynamic=True)
    for tokens in (5, 11, 1, 32):
        x, ids, w = routed_inputs(experts, tokens=tokens)
        assert max_rel_err(compiled(x, ids, w), experts(x, ids, w)) <= TOLERANCE[torch.float32]
    assert counters["uniep"]["moe_experts"] >= 1
    assert counters["stats"]["unique_graphs"] <= 2, "varying token counts must not recompile each time"


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_bad_input_through_the_compiled_path(implementation):
    """An empty batch, NaN/inf hidden states and NaN routing weights behave as in eager."""
    cls = dict((c.__name__, c) for _, c in FAMILIES)["MixtralExperts"]
    experts = build_experts(cls, implementation, torch.float32)
    compiled = torch.compile(experts, backend="uniep", options={"inner_backend": "eager"})
    with torch.no_grad():
        x, ids, w = routed_inputs(experts, tokens=0, requires_grad=False)
        assert compiled(x, ids, w).shape == (0, x.shape[1])
        x, ids, w = routed_inputs(experts, tokens=6, requires_grad=False)
        x[1, 0] = float("nan")
        x[2, 3] = float("inf")
        w[4, 1] = float("nan")
        out, eager = compiled(x, ids, w), experts(x, ids, w)
        assert torch.equal(torch.isnan(out), torch.isnan(eager))
        assert max_rel_err(out[[0, 3, 5]], eager[[0, 3, 5]]) <= TOLERANCE[torch.float32]
    assert counters["uniep"]["moe_experts"] >= 1
