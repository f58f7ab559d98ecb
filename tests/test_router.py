"""The router pattern and the uniep::moe_router op: HF's own router modules compiled with uniep against
eager (values, ids, gradients), the cases that must not match, and the fused routing kernel against the
reference in Triton's interpreter."""
import importlib

import pytest
import torch
from torch._dynamo.utils import counters

import uniep_dynamo  # noqa: F401  (registers the backend and the ops)
from uniep_dynamo.kernels import router_reference
from uniep_dynamo.spec import RouterSpec, decode_router_spec

transformers = pytest.importorskip("transformers", reason="the HF router modules need transformers")

# family -> (router class, config overrides): the routers of the named families, tiny.
ROUTERS = {
    "mixtral": ("MixtralTopKRouter", {}),  # softmax(fp32) -> top-k -> renorm, fp32 weights
    "qwen3_moe": ("Qwen3MoeTopKRouter", {}),  # softmax(dtype=float) -> top-k -> renorm -> cast
    "qwen2_moe": ("Qwen2MoeTopKRouter", {"norm_topk_prob": False}),  # no renorm
    "olmoe": ("OlmoeTopKRouter", {}),
    "gpt_oss": ("GptOssTopKRouter", {}),  # linear with bias -> top-k of logits -> softmax over K
    "deepseek_v3": ("DeepseekV3TopkRouter", {}),  # fp32 linear, sigmoid, score bias, groups, scale
}


def make_router(family, dtype=torch.float32, seed=0, **overrides):
    from hf_models import COMMON, FAMILIES

    config_name, extra = FAMILIES[family]
    cls_name, router_extra = ROUTERS[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **router_extra, **overrides})
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(seed)
    router = getattr(module, cls_name)(config)
    with torch.no_grad():
        for name, p in router.named_parameters():
            p.normal_(0.0, 0.3)
        for name, b in router.named_buffers():
            b.normal_(0.0, 0.1)
    return router.to(dtype)


def hidden_states(n=11, h=32, dtype=torch.float32, seed=1):
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sort_by_id(weights, ids):
    """HF's DeepSeek router asks top-k for sorted=False: compare the K slots as a set."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def run_router(router, x, compiled, loss_weights=(1.0, 0.5)):
    """(logits, weights, ids, grad of x, grads of the router parameters) of one forward/backward."""
    x = x.detach().clone().requires_grad_()
    router.zero_grad()
    fn = torch.compile(router, backend="uniep", options={"inner_backend": "aot_eager"}) if compiled else router
    logits, weights, ids = fn(x)
    g = torch.Generator().manual_seed(7)
    # a coefficient per (token, expert), so the loss does not depend on the order of the K slots
    per_expert = torch.randn(logits.shape, generator=g)
    loss = (weights.float() * per_expert.gather(1, ids)).sum() * loss_weights[0] + \
        (logits.float() * torch.randn(logits.shape, generator=g)).sum() * loss_weights[1]
    loss.backward()
    return logits, weights, ids, x.grad, {n: p.grad.clone() for n, p in router.named_parameters()
                                          if p.grad is not None}


def assert_router_matches_eager(router, x, sorted_ids=True, atol=1e-5):
    torch._dynamo.reset()
    counters.clear()
    ref = run_router(router, x, compiled=False)
    got = run_router(router, x, compiled=True)
    assert counters["uniep"]["moe_router"] == 1, dict(counters["uniep"])
    assert counters["uniep"]["router_unfused"] == 0
    r_w, r_ids = (ref[1], ref[2]) if sorted_ids else sort_by_id(ref[1], ref[2])
    g_w, g_ids = (got[1], got[2]) if sorted_ids else sort_by_id(got[1], got[2])
    assert torch.equal(g_ids, r_ids)
    assert got[1].dtype == ref[1].dtype and got[0].dtype == ref[0].dtype
    torch.testing.assert_close(got[0], ref[0], atol=atol, rtol=atol)
    torch.testing.assert_close(g_w, r_w, atol=atol, rtol=atol)
    torch.testing.assert_close(got[3], ref[3], atol=atol, rtol=atol)
    for name in ref[4]:
        torch.testing.assert_close(got[4][name], ref[4][name], atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_hf_router_matches_eager(family):
    router = make_router(family)
    assert_router_matches_eager(router, hidden_states(), sorted_ids=family != "deepseek_v3")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_hf_router_k1_and_k_equals_e(family):
    experts = 8 if family == "deepseek_v3" else 4
    for k in (1, experts):
        extra = {"n_group": 1, "topk_group": 1} if family == "deepseek_v3" else {}
        router = make_router(family, num_experts_per_tok=k, **extra)
        assert_router_matches_eager(router, hidden_states(), sorted_ids=family != "deepseek_v3")


def test_deepseek_group_limited_topk_group_1():
    # one group of two experts allowed per token: K=2 must pick exactly that group's experts
    router = make_router("deepseek_v3", n_group=4, topk_group=1)
    assert_router_matches_eager(router, hidden_states(), sorted_ids=False)
    _logits, _w, ids = router(hidden_states())
    assert torch.equal(ids.sort(dim=-1).values[:, 0] // 2, ids.sort(dim=-1).values[:, 1] // 2)


def test_ties_go_to_the_lower_expert_index():
    # A zero gate weight: every logit is 0 and all experts tie. The op picks experts 0..K-1 on every
    # device; torch.topk's order among ties is implementation-defined, so eager's ids are only checked
    # to be an equally good choice (the same weights).
    router = make_router("mixtral", num_local_experts=8, num_experts_per_tok=3)
    with torch.no_grad():
        router.weight.zero_()
    torch._dynamo.reset()
    _, weights, ids = torch.compile(router, backend="uniep", options={"inner_backend": "eager"})(hidden_states())
    assert torch.equal(ids, torch.tensor([[0, 1, 2]] * 11))
    assert torch.equal(weights, router(hidden_states())[1])


def test_nan_logits_propagate_like_eager():
    router = make_router("qwen3_moe")
    x = hidden_states()
    x[3, 5] = float("nan")
    torch._dynamo.reset()
    ref = router(x)
    got = torch.compile(router, backend="uniep", options={"inner_backend": "eager"})(x)
    assert torch.isnan(got[1][3]).all() and torch.isnan(ref[1][3]).all()
    # every expert of token 3 ties (NaN): the op takes the lowest ids, torch.topk any
    assert torch.equal(got[2][3], torch.arange(2))
    keep = torch.arange(11) != 3
    assert torch.equal(got[2][keep], ref[2][keep])
    torch.testing.assert_close(got[1][keep], ref[1][keep])


def test_reduced_precision_router_fp16():
    router = make_router("qwen3_moe", dtype=torch.float16)
    assert_router_matches_eager(router, hidden_states(dtype=torch.float16), atol=2e-3)


def test_logits_escape_and_stay_exact():
    # the logits are returned (the load-balancing loss reads them): they stay available and equal
    router = make_router("mixtral")
    x = hidden_states()
    torch._dynamo.reset()
    got = torch.compile(router, backend="uniep")(x)
    torch.testing.assert_close(got[0], router(x)[0])


def compile_and_compare(module, x, matched=1):
    """(compiled outputs, eager outputs) of a hand-written router; checks the rewrite count."""
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(module, backend="uniep", options={"inner_backend": "eager"})(x)
    assert counters["uniep"]["moe_router"] == matched
    ref = module(x)
    return got, ref


# -- must not match -------------------------------------------------------------------------------
class HandRouter(torch.nn.Module):
    """A Mixtral-style router with one step changed per variant."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.weight = torch.nn.Parameter(torch.randn(6, 16) * 0.3)

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits, dim=0 if self.variant == "softmax_dim0" else -1)
        values, ids = torch.topk(probs, 2, dim=-1, largest=self.variant != "smallest")
        if self.variant == "escaping_probs":
            return values / values.sum(-1, keepdim=True), ids, probs
        if self.variant == "mean":  # the router region ends at the top-k values; the mean runs outside
            return values / values.mean(-1, keepdim=True), ids
        if self.variant == "no_keepdim":
            return values / values.sum(-1, keepdim=True), ids
        return values / values.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("variant,reason", [
    ("smallest", "top-k of the smallest scores"),
    ("softmax_dim0", "softmax over dim 0, not the last"),
    ("escaping_probs", "is also used by output"),
])
def test_router_variants_that_must_not_match(variant, reason, caplog):
    torch.manual_seed(0)
    module = HandRouter(variant)
    x = torch.randn(5, 16)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level("WARNING", logger="uniep"):
        got = torch.compile(module, backend="uniep", options={"inner_backend": "eager"})(x)
    assert counters["uniep"]["moe_router"] == 0
    assert counters["uniep"]["router_unfused"] == 1
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    for a, b in zip(got, module(x)):
        torch.testing.assert_close(a, b)


def test_router_region_ends_where_the_pattern_ends():
    # values / values.mean(): the op yields the top-k probabilities; the division stays in the graph
    torch.manual_seed(0)
    module = HandRouter("mean")
    x = torch.randn(5, 16)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(module, backend="uniep", options={"inner_backend": "eager"})(x)
    assert counters["uniep"]["moe_router"] == 1 and counters["uniep"]["router_unfused"] == 0
    for a, b in zip(got, module(x)):
        torch.testing.assert_close(a, b)


def test_plain_linear_and_topk_elsewhere_is_not_a_router():
    # a top-k over a linear whose values are not turned into routing weights: nothing to rewrite
    class Retrieval(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 10, bias=False)

        def forward(self, x):
            return torch.topk(self.proj(x), 3, dim=-1).indices

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(Retrieval(), backend="uniep", options={"inner_backend": "eager"})(torch.randn(4, 16))
    assert out.shape == (4, 3) and counters["uniep"]["moe_router"] == 0


# -- the op ---------------------------------------------------------------------------------------
def test_spec_round_trip_and_validation():
    spec = RouterSpec("sigmoid_topk", 16, 4, linear_fp32=True, has_score_bias=True, n_group=4, topk_group=2,
                      renorm=True, renorm_eps=1e-20, scale=2.5, weights_dtype=torch.bfloat16)
    assert decode_router_spec(spec.encode()) == spec
    with pytest.raises(ValueError, match="top_k"):
        decode_router_spec(RouterSpec("softmax_topk", 4, 5).encode())
    with pytest.raises(ValueError, match="groups"):
        decode_router_spec(RouterSpec("sigmoid_topk", 6, 2, n_group=4, topk_group=2).encode())


def test_empty_batch():
    spec = RouterSpec("softmax_topk", 8, 2, renorm=True)
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    logits, weights, ids = torch.ops.uniep.moe_router(x, w, None, None, spec.encode())[:3]
    assert logits.shape == (0, 8) and weights.shape == (0, 2) and ids.shape == (0, 2)
    weights.sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("mode", ["softmax_topk", "sigmoid_topk", "topk_softmax"])
def test_backward_formula_against_autograd(mode):
    # the hand-written backward against autograd through the reference forward, in float64
    spec = RouterSpec(mode, 8, 3, renorm=mode != "topk_softmax", renorm_eps=1e-20 if mode == "sigmoid_topk" else 0.0,
                      scale=2.5 if mode == "sigmoid_topk" else 1.0, weights_dtype=torch.float64, has_bias=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    logits, weights, ids = router_reference.router_forward(x, w, b, None, spec)
    gw, gl = torch.randn(weights.shape, generator=g, dtype=torch.float64), torch.randn(logits.shape, generator=g,
                                                                                         dtype=torch.float64)
    expect = torch.autograd.grad((weights * gw).sum() + (logits * gl).sum(), (x, w, b))
    got = router_reference.router_backward(gl, gw, x, w, b, logits.detach(), ids, spec)
    for a, e in zip(got, expect):
        torch.testing.assert_close(a, e)


# -- the fused routing kernel (Triton's interpreter) ------------------------------------------------
KERNEL_CASES = [
    # (spec, tokens, hidden size, dtype, what it stresses)
    (RouterSpec("softmax_topk", 8, 2, renorm=True), 37, 40, torch.float32),  # Mixtral; T, H off the tiles
    (RouterSpec("softmax_topk", 60, 4), 5, 24, torch.float32),  # E not a power of two (padded columns)
    (RouterSpec("softmax_topk", 128, 8, renorm=True, weights_dtype=torch.float16), 33, 64, torch.float16),  # Qwen3
    (RouterSpec("softmax_topk", 8, 8, renorm=True), 17, 16, torch.float32),  # K = E
    (RouterSpec("softmax_topk", 8, 1), 1, 16, torch.float32),  # K = 1, T = 1
    (RouterSpec("topk_softmax", 32, 4, has_bias=True, score_fp32=False), 19, 48, torch.float32),  # GPT-OSS
    (RouterSpec("topk_softmax", 32, 4, has_bias=True, score_fp32=False, weights_dtype=torch.float16), 19, 48,
     torch.float16),
    (RouterSpec("sigmoid_topk", 16, 4, linear_fp32=True, has_score_bias=True, n_group=4, topk_group=2, renorm=True,
                renorm_eps=1e-20, scale=2.5), 21, 40, torch.float32),  # DeepSeek-V3 style
    (RouterSpec("sigmoid_topk", 256, 8, linear_fp32=True, has_score_bias=True, n_group=8, topk_group=4, renorm=True,
                renorm_eps=1e-20, scale=2.5), 18, 32, torch.float16),  # DeepSeek-V3 sizes, fp16 input
    (RouterSpec("sigmoid_topk", 16, 2, linear_fp32=True, has_score_bias=True, n_group=8, topk_group=1), 9, 16,
     torch.float32),  # topk_group = 1
    (RouterSpec("sigmoid_topk", 16, 3), 9, 16, torch.float32),  # plain sigmoid, no bias, no groups
]


def _kernel_inputs(spec, tokens, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(spec.num_experts, hidden, generator=g) * 0.3).to(dtype)
    b = torch.randn(spec.num_experts, generator=g).to(dtype) if spec.has_bias else None
    sb = torch.randn(spec.num_experts, generator=g) * 0.1 if spec.has_score_bias else None
    return x, w, b, sb


def _interpreting():
    from uniep_dynamo.kernels.config import interpreting
    return interpreting()


needs_interpreter = pytest.mark.skipif(not _interpreting(), reason="the kernel runs on CPU tensors in Triton's "
                                       "interpreter (TRITON_INTERPRET=1, set by conftest without a GPU)")


def _compare_kernel(spec, x, w, b, sb, monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from uniep_dynamo.kernels import megakernel, triton_router

    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    assert megakernel.router_unsupported_reason(x, w, b, spec) is None
    ref = router_reference.router_forward(x, w, b, sb, spec)
    got = triton_router.router_forward(x, w, b, sb, spec)
    assert torch.equal(got[2], ref[2]), (got[2], ref[2])
    tol = 2e-3 if x.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], ref[1], atol=tol, rtol=tol)
    # the routing plan from the select kernel's histograms equals the reference's stable sort of the ids
    import dataclasses

    from uniep_dynamo.kernels import reference
    with_plan = triton_router.router_forward(x, w, b, sb, dataclasses.replace(spec, plan=True))
    assert torch.equal(with_plan[2], got[2])
    for a, e in zip(with_plan[3:], reference.routing_plan(got[2], spec.num_experts)):
        assert torch.equal(a, e)
    # backward: the d_logits kernel + GEMMs against the reference formulas, with and without each gradient
    g = torch.Generator().manual_seed(5)
    gw = torch.randn(ref[1].shape, generator=g).to(ref[1].dtype)
    gl = torch.randn(ref[0].shape, generator=g).to(ref[0].dtype)
    for grads in ((gl, gw), (None, gw), (gl, None)):
        expect = router_reference.router_backward(*grads, x, w, b, ref[0], ref[2], spec)
        actual = triton_router.router_backward(*grads, x, w, b, ref[0], ref[2], spec)
        for a, e in zip(actual, expect):
            if e is not None:
                torch.testing.assert_close(a, e, atol=5 * tol, rtol=5 * tol)
    return got


@needs_interpreter
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0].mode}-E{c[0].num_experts}-K{c[0].top_k}-"
                         f"{str(c[3])[6:]}" if isinstance(c, tuple) else str(c))
def test_fused_router_kernel_against_reference(case, monkeypatch):
    spec, tokens, hidden, dtype = case
    _compare_kernel(spec, *_kernel_inputs(spec, tokens, hidden, dtype), monkeypatch)


@needs_interpreter
def test_fused_router_kernel_ties_nan_and_empty(monkeypatch):
    spec = RouterSpec("softmax_topk", 16, 4, renorm=True)
    x, w, _, _ = _kernel_inputs(spec, 12, 16, torch.float32)
    w[3] = w[5]  # experts 3 and 5 tie on every token
    w[9] = w[5]
    x[2] = 0.0  # a token whose experts all tie
    got = _compare_kernel(spec, x, w, None, None, monkeypatch)
    assert torch.equal(got[2][2], torch.arange(4))
    x[4, 1] = float("nan")  # NaN logits: NaN weights on that token, like the reference
    from uniep_dynamo.kernels import triton_router
    got = triton_router.router_forward(x, w, None, None, spec)
    ref = router_reference.router_forward(x, w, None, None, spec)
    assert torch.isnan(got[1][4]).all() and torch.isnan(ref[1][4]).all()
    keep = torch.arange(12) != 4
    assert torch.equal(got[2][keep], ref[2][keep])
    empty = triton_router.router_forward(x[:0], w, None, None, spec)
    assert [t.shape for t in empty[:3]] == [(0, 16), (0, 4), (0, 4)]


@needs_interpreter
def test_fused_router_through_the_op_and_autograd(monkeypatch):
    spec = RouterSpec("sigmoid_topk", 16, 4, linear_fp32=True, has_score_bias=True, n_group=4, topk_group=2,
                      renorm=True, renorm_eps=1e-20, scale=2.5)
    x, w, _, sb = _kernel_inputs(spec, 10, 24, torch.float32)
    results = {}
    for mode in ("triton", "reference"):
        monkeypatch.setenv("UNIEP_KERNELS", mode)
        counters.clear()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits, weights, ids = torch.ops.uniep.moe_router(xs, ws, None, sb, spec.encode())[:3]
        (weights * torch.arange(4.0)).sum().backward()
        results[mode] = (weights, ids, xs.grad, ws.grad)
        assert counters["uniep_kernels"]["triton_router"] == (1 if mode == "triton" else 0)
    for a, b in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(a, b)


# Triton's interpreter accepts some code the compiler refuses (a plain global in a kernel, say): compile
# every variant of the routing kernel for Hopper ahead of time, which needs no GPU. A subprocess, since
# conftest turns the interpreter on for this one.
AOT_VARIANTS = [
    # (logits dtype, weights dtype, constexprs beyond the defaults)
    ("bf16", "fp32", dict(MODE=0, E_PAD=16, K=2, K_PAD=2, BLOCK_T=64)),  # Mixtral
    ("bf16", "bf16", dict(MODE=0, E_PAD=128)),  # Qwen3
    ("fp16", "fp16", dict(MODE=2, E_PAD=32, K=4, K_PAD=4, RENORM=False, BLOCK_T=64)),  # GPT-OSS
    ("fp32", "fp32", dict(MODE=1, E_PAD=256, N_GROUP=8, TOPK_GROUP=4, HAS_SB=True, BLOCK_T=16)),  # DeepSeek-V3
    ("bf16", "bf16", dict(MODE=1, E_PAD=64, ROUND_SCORES=True)),
]

_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from uniep_dynamo.kernels.triton_router import _router_grad, _router_select
target = GPUTarget("cuda", 90, 32)
common = {{"num_tokens": "i32", "num_experts": "i32", "scale": "fp32", "renorm_eps": "fp32"}}
for ldt, wdt, extra in {variants!r}:
    consts = {{**dict(K=8, K_PAD=8, N_GROUP=1, TOPK_GROUP=1, HAS_SB=False, ROUND_SCORES=False, RENORM=True,
                      BLOCK_T=32), **extra}}
    consts.update(PLAN=True, NUM_KEYS=max(16, 2 * consts["E_PAD"]))
    sig = {{"logits_ptr": "*" + ldt, "sb_ptr": "*fp32", "weights_ptr": "*" + wdt, "ids_ptr": "*i64",
            "hist_ptr": "*i32", **common}}
    sig.update({{k: "constexpr" for k in consts}})
    kernel = triton.compile(triton.compiler.ASTSource(fn=_router_select, signature=sig, constexprs=consts),
                            target=target)
    assert "ptx" in kernel.asm
    grad = {{k: consts[k] for k in ("MODE", "K", "E_PAD", "RENORM", "BLOCK_T")}}
    grad.update(HAS_GW=True, HAS_GL=True)
    sig = {{"logits_ptr": "*" + ldt, "ids_ptr": "*i64", "gw_ptr": "*" + wdt, "gl_ptr": "*" + ldt, "dl_ptr": "*" + ldt,
            **common}}
    sig.update({{k: "constexpr" for k in grad}})
    kernel = triton.compile(triton.compiler.ASTSource(fn=_router_grad, signature=sig, constexprs=grad),
                            target=target)
    assert "ptx" in kernel.asm
    print("compiled", ldt, extra)
"""


def test_routing_kernel_compiles_for_hopper():
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT.format(variants=AOT_VARIANTS)], env=env,
                          capture_output=True, text=True, timeout=600)
    if "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this triton has no ahead-of-time compilation API (triton.backends.compiler.GPUTarget)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == len(AOT_VARIANTS)


# -- the routing plan, computed by the router op for its experts op --------------------------------

# DeepSeek-V3's group-limited router (its most involved plan source); softmax top-k routers share theirs the same
# way, and test_experts_op_with_the_routers_plan_is_bitwise_equal covers that at the op level. Two whole-model
# compiles with aot_eager behind the rewrite (the plan is the rewrite's; inductor's code adds nothing here).
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_router_shares_its_routing_plan_with_the_experts_op(family):
    from hf_models import build_model

    from uniep_dynamo.report import recording

    model = build_model(family)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    results, router_specs = [], {}
    for share in (True, False):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        with recording() as recorder:
            compiled = torch.compile(model, backend="uniep",
                                     options={"share_routing_plan": share, "inner_backend": "aot_eager"})
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
        router_specs[share] = [r["spec"] for r in recorder.to_dict()["graphs"][0]["rewrites"]
                               if r["op"] == "moe_router"]
        results.append([out.loss, out.logits] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(router_specs[True]) == 2 and all("routing plan" in spec for spec in router_specs[True])
    assert len(router_specs[False]) == 2 and not any("routing plan" in spec for spec in router_specs[False])
    for a, b in zip(*results):  # the same plan either way: bitwise equal
        assert torch.equal(a, b)


@needs_interpreter
def test_experts_op_with_the_routers_plan_is_bitwise_equal(monkeypatch):
    # the MegaKernel fed the router's plan against the same MegaKernel building its own
    import dataclasses

    from test_reference import SILU_GLU, make

    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    hidden, _ids, _w, w_up, w_down, _b_up, _b_down, spec = make(19, 16, 24, 8, 3, gate=SILU_GLU)
    rspec = RouterSpec("softmax_topk", 8, 3, renorm=True, plan=True)
    router_w = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for plan_in in (True, False):
        leaves = [t.clone().requires_grad_() for t in (hidden, router_w, w_up, w_down)]
        logits, weights, ids, *plan = torch.ops.uniep.moe_router(leaves[0], leaves[1], None, None, rspec.encode())
        given = tuple(plan) if plan_in else ()
        out = torch.ops.uniep.moe_experts(leaves[0], ids, weights, leaves[2], leaves[3], None, None, [],
                                          spec.encode(), *given)[0]
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_topk_then_fp32_softmax_keeps_fp32_weights():
    # a GPT-OSS-like router in fp16 whose softmax over the K logits asks for float32
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 16) * 0.3)
            self.bias = torch.nn.Parameter(torch.randn(8) * 0.1)

        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight, self.bias)
            top, ids = torch.topk(logits, 2, dim=-1)
            return logits, torch.softmax(top, dim=-1, dtype=torch.float32), ids

    torch.manual_seed(0)
    got, ref = compile_and_compare(Router().half(), torch.randn(7, 16).half())
    assert got[1].dtype == torch.float32 and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-6)


def test_cast_feeding_the_linear_stays_an_input():
    # a no-op cast right before the linear is the op's hidden input, not part of the region
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(6, 16) * 0.3)

        def forward(self, x):
            logits = torch.nn.functional.linear(x.to(torch.float16), self.weight)
            values, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), 2, dim=-1)
            return values / values.sum(dim=-1, keepdim=True), ids

    torch.manual_seed(0)
    got, ref = compile_and_compare(Router().half(), torch.randn(5, 16).half())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


# -- every HF router class ----------------------------------------------------------------------------
def _router_classes():
    from hf_families import discover_router_classes
    return discover_router_classes()


ROUTER_CLASSES = _router_classes()
# Families whose router the pattern rewrites (transformers 5.23): a guard against losing one.
REWRITTEN_ROUTER_FAMILIES = {"aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_ocr2",
                             "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "dots3_note", "exaone_moe",
                             "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm5_next",
                             "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                             "granitemoeshared", "hunyuan_v1_moe", "hy_v4", "inkling2", "jamba", "kimi_linear",
                             "laguna", "mellum", "mimo_v2_flash", "minimax", "minimax_m3_vl", "mixtral",
                             "nemotron_h", "olmoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
                             "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "unlimited_ocr"}


@pytest.mark.parametrize("family, cls", ROUTER_CLASSES, ids=[c.__name__ for _, c in ROUTER_CLASSES])
def test_every_hf_router_class_is_rewritten_right_or_left_alone(family, cls):
    """Each router module of the installed transformers, tiny, compiled with uniep: where the pattern
    rewrites it, ids, weights, logits and gradients equal eager's; where it does not, the module runs
    unchanged. Either way nothing differs from eager."""
    from hf_families import build_router

    try:
        router, config = build_router(cls)
        x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(2))
        out = router(x)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{cls.__name__} does not build or run from its family's default config shrunk ({exc!r:.120})")
    if not (isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point()):
        pytest.skip(f"{cls.__name__} returns {type(out).__name__}, not (logits, weights, ids)")
    torch._dynamo.reset()
    counters.clear()
    ref = run_router(router, x, compiled=False)
    got = run_router(router, x, compiled=True)
    rewritten = counters["uniep"]["moe_router"]
    r_w, r_ids = sort_by_id(ref[1], ref[2])
    g_w, g_ids = sort_by_id(got[1], got[2])
    assert torch.equal(g_ids, r_ids)
    torch.testing.assert_close(g_w, r_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3], ref[3], atol=1e-5, rtol=1e-5)
    assert got[4].keys() == ref[4].keys()
    for name in ref[4]:
        torch.testing.assert_close(got[4][name], ref[4][name], atol=1e-5, rtol=1e-5, msg=name)
    if family in REWRITTEN_ROUTER_FAMILIES:
        assert rewritten == 1, f"{cls.__name__}: the router pattern no longer rewrites this router"


@pytest.mark.parametrize("spelling", ["F.softmax", "torch.softmax", "Tensor.softmax"])
def test_softmax_dtype_in_every_spelling(spelling):
    # the fp32 upcast is read wherever the call puts its dtype argument
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 16) * 0.5)

        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight)
            if spelling == "F.softmax":
                probs = torch.nn.functional.softmax(logits, -1, 3, torch.float32)
            elif spelling == "torch.softmax":
                probs = torch.softmax(logits, -1, torch.float32)
            else:
                probs = logits.softmax(-1, torch.float32)
            values, ids = torch.topk(probs, 2, dim=-1)
            return values / values.sum(dim=-1, keepdim=True), ids

    torch.manual_seed(0)
    got, ref = compile_and_compare(Router().half(), torch.randn(9, 16).half())
    assert got[0].dtype == torch.float32 and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
