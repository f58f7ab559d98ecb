"""GPU: the fused routing kernel in bf16 at model sizes, against eager HF routers, run to run, and with
the experts op in whole models."""
import pytest
import torch
from torch._dynamo.utils import counters

import uniep_dynamo  # noqa: F401
from uniep_dynamo.kernels import router_reference
from uniep_dynamo.spec import RouterSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")]
transformers = pytest.importorskip("transformers", reason="the HF router modules need transformers")

# family: (config class, router class, config at the model's router sizes)
ROUTERS = {
    "mixtral": ("MixtralConfig", "MixtralTopKRouter", dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeTopKRouter", dict(hidden_size=2048, num_experts=128,
                                                              num_experts_per_tok=8, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeTopKRouter", dict(hidden_size=2048, num_experts=64, num_experts_per_tok=8)),
    "gpt_oss": ("GptOssConfig", "GptOssTopKRouter", dict(hidden_size=2880, num_local_experts=32, num_experts_per_tok=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3TopkRouter", dict(
        hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
}


def make_router(family, dtype=torch.bfloat16):
    import importlib

    config_name, cls_name, overrides = ROUTERS[family]
    config = getattr(transformers, config_name)(**overrides)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        router = getattr(module, cls_name)(config)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0.0, 0.02)
        for b in router.buffers():
            b.normal_(0.0, 0.01)
    return router.to(dtype)


def fwd_bwd(fn, router, x, g):
    router.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    logits, weights, ids = fn(xs)
    order = ids.argsort(dim=-1)  # DeepSeek's router asks for sorted=False: compare K slots by id
    (weights.float() * g.gather(1, ids)).sum().backward()
    return (logits, weights.gather(1, order), ids.gather(1, order), xs.grad,
            {n: p.grad.clone() for n, p in router.named_parameters()})


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_fused_router_matches_eager_bf16(family):
    router = make_router(family)
    hidden = router.weight.shape[1]
    num_experts = router.weight.shape[0]
    x = torch.randn(4099, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4099, num_experts, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    ref = fwd_bwd(router, router, x, g)
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(router, backend="uniep")
    got = fwd_bwd(fn, router, x, g)
    assert counters["uniep"]["moe_router"] == 1 and counters["uniep_kernels"]["triton_router"] >= 1
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)  # bf16 logits, other GEMM
    # bf16 scores tie often; the op breaks ties by the lower id, torch.topk its own way. Tokens whose ids
    # differ must hold equally good choices: the same weights as a multiset.
    same = (got[2] == ref[2]).all(dim=-1)
    assert same.float().mean() > 0.95, f"only {same.float().mean():.3f} of tokens chose eager's experts"
    torch.testing.assert_close(got[1].float().sort(dim=-1).values, ref[1].float().sort(dim=-1).values,
                               atol=2e-2, rtol=2e-2)
    if same.all():
        torch.testing.assert_close(got[3].float(), ref[3].float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fused_router_bitwise_over_20_runs(family):
    router = make_router(family)
    x = torch.randn(2048, router.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2048, router.weight.shape[0], device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    torch._dynamo.reset()
    fn = torch.compile(router, backend="uniep")
    first = fwd_bwd(fn, router, x, g)
    for _ in range(19):
        again = fwd_bwd(fn, router, x, g)
        for a, b in zip(first[:4], again[:4]):
            assert torch.equal(a, b)
        for name in first[4]:
            assert torch.equal(first[4][name], again[4][name]), name


def test_fused_router_against_float64_reference():
    spec = RouterSpec("sigmoid_topk", 256, 8, linear_fp32=True, has_score_bias=True, n_group=8, topk_group=4,
                      renorm=True, renorm_eps=1e-20, scale=2.5)
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    sb = torch.randn(256, device="cuda") * 0.01
    counters.clear()
    logits, weights, ids = torch.ops.uniep.moe_router(x, w, None, sb, spec.encode())[:3]
    assert counters["uniep_kernels"]["triton_router"] == 1
    ref = router_reference.router_forward(x.double(), w.double(), None, sb.double(),
                                          RouterSpec(**{**spec.__dict__, "weights_dtype": torch.float64,
                                                                 "linear_fp32": False}))
    assert (ids == ref[2]).all(dim=-1).float().mean() > 0.99
    torch.testing.assert_close(logits.double(), ref[0], atol=1e-5, rtol=1e-5)


def test_ties_on_cuda_go_to_the_lower_expert_index():
    spec = RouterSpec("softmax_topk", 64, 8, renorm=True)
    x = torch.zeros(5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    _, weights, ids = torch.ops.uniep.moe_router(x, w, None, None, spec.encode())[:3]
    assert torch.equal(ids, torch.arange(8, device="cuda").expand(5, 8))
    assert torch.equal(weights, torch.full_like(weights, 1 / 8))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_whole_model_bf16_router_and_experts_rewritten(family):
    import sys
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_models import build_model

    model = build_model(family, dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 96, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = model(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(model, backend="uniep")(input_ids=ids, labels=ids).loss
    loss.backward()
    assert counters["uniep"]["moe_router"] == 2 and counters["uniep"]["moe_experts"] == 2
    torch.testing.assert_close(loss.float(), eager.float(), atol=3e-2, rtol=3e-2)


def test_shared_routing_plan_is_bitwise_neutral_on_gpu():
    """The router op's plan (histograms from the select kernel) against the experts op's own sort."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_models import build_model

    model = build_model("qwen3_moe", dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 96, (4, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for share in (True, False):
        torch._dynamo.reset()
        counters.clear()
        model.zero_grad(set_to_none=True)
        out = torch.compile(model, backend="uniep", options={"share_routing_plan": share})(input_ids=ids, labels=ids)
        out.loss.backward()
        assert counters["uniep_kernels"]["triton_router"] >= 2 and counters["uniep_kernels"]["triton_forward"] >= 2
        results.append([out.loss, out.logits] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*results):
        assert torch.equal(a, b)
