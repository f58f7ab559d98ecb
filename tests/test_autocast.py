"""Autocast around an fp32 model: uniep computes each region in the dtypes eager does under the same autocast, or
leaves it unfused with the reason logged (issue 36).

What eager does under CPU autocast (recorded by Dynamo in the nodes' example values, the matchers' proof):
    router `linear`          casts hidden and gate weight to the autocast dtype: bf16/fp16 logits
    batched_mm `bmm`         casts the gathered fp32 weights and rows: GEMMs, activation and K-sum in bf16/fp16,
                             then `.to(fp32)`
    grouped_mm               HF's `grouped_mm_fallback` custom op is on no autocast list: the GEMMs stay fp32,
                             the routing weights (cast to the logits' dtype) are bf16/fp16
    GPT-OSS batched_mm       the fp32 expert biases are added (in place) to the bf16 GEMM outputs: one compute
                             dtype cannot do that, so the experts run unfused
The op is fed the same casts (hidden states and weights cast to the GEMMs' dtype), so its inputs in the
rewritten graph show the dtype it computes in; these tests assert that dtype, the counters, and that outputs and
all gradients match eager under the same autocast within the autocast dtype's tolerance.
"""
import logging

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_models import build_model

BF16, FP16 = torch.bfloat16, torch.float16


def _compile(fn, graphs):
    """fn compiled by uniep, AOTAutograd behind it (forward and backward traced); the rewritten graphs kept."""
    aot_eager = lookup_backend("aot_eager")

    def keep(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return torch.compile(fn, backend="uniep", options={"inner_backend": keep})


def _ops(graphs, op):
    """The calls of torch.ops.uniep.<op> in the rewritten graphs and in the bodies they call."""
    return [n for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is getattr(torch.ops.uniep, op).default]


def _input_dtype(call, i=0):
    return call.args[i].meta["example_value"].dtype


def _run(fn, block, x):
    """Output and gradients (input and every parameter) of fn(x), with a loss that weighs each output element."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's block returns (hidden, router scores)
    weights = torch.linspace(-1.0, 1.0, out.numel(), device=out.device).view_as(out)
    (out.float() * weights).sum().backward()
    grads = {"input": x.grad}
    grads.update({n: p.grad for n, p in block.named_parameters() if p.grad is not None})
    return out.detach(), grads


def _autocast_fns(block, dtype, where):
    """(eager fn, fn to compile, context to call both in) for autocast entered outside or inside the compiled fn."""
    def inside(x):
        with torch.autocast("cpu", dtype=dtype):
            return block(x)

    if where == "inside":
        return inside, inside, torch.autocast("cpu", enabled=False)
    return block, block, torch.autocast("cpu", dtype=dtype)


def _compare(block, dtype, where, x, compile_fn=None):
    eager_fn, compiled_fn, context = _autocast_fns(block, dtype, where)
    graphs = []
    compiled = _compile(compile_fn or compiled_fn, graphs)
    with context:
        out, grads = _run(eager_fn, block, x)
        c_out, c_grads = _run(compiled, block, x)
    assert c_out.dtype == out.dtype
    assert max_rel_err(c_out, out) <= TOLERANCE[dtype]
    assert c_grads.keys() == grads.keys()
    for name in grads:
        assert c_grads[name].dtype == grads[name].dtype, name
        assert max_rel_err(c_grads[name], grads[name]) <= TOLERANCE[dtype], name
    return graphs


def _moe_block(family, implementation):
    model = build_model(family, torch.float32, implementation)
    return model.model.layers[0].mlp


def _tokens(seed=0):
    return torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed))


# The softmax-top-k router with norm_topk_prob (Qwen3-MoE), both experts spellings, both autocast dtypes, autocast
# entered outside the compiled call (global state, guarded) and inside it (_enter_autocast nodes).
@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("implementation, experts_dtype", [
    ("batched_mm", None),  # bmm is autocast: the op runs in the autocast dtype (the reported bug ran it in fp32)
    ("grouped_mm", torch.float32),  # grouped_mm_fallback is no autocast op: eager's GEMMs stay fp32
])
def test_qwen3_block_runs_in_eager_dtypes(implementation, experts_dtype, dtype, where):
    block = _moe_block("qwen3_moe", implementation)
    graphs = _compare(block, dtype, where, _tokens())
    assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["unfused"] == 0
    (experts,) = _ops(graphs, "moe_experts")
    # hidden states and both expert weights reach the op in the dtype eager's GEMMs ran in
    want = experts_dtype or dtype
    assert [_input_dtype(experts, i) for i in (0, 3, 4)] == [want] * 3
    assert counters["uniep"]["moe_router"] == 1 and counters["uniep"]["router_unfused"] == 0
    (router,) = _ops(graphs, "moe_router")
    assert [_input_dtype(router, i) for i in (0, 1)] == [dtype, dtype]  # linear is autocast on CPU


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_gpt_oss_block_under_autocast(implementation, caplog):
    """GPT-OSS: top-k then softmax router (rewritten in the autocast dtype); expert biases in fp32. Under
    batched_mm eager adds those to bf16 GEMM outputs, which the op cannot: unfused, with the reason. Under
    grouped_mm the GEMMs stay fp32 and the op runs in fp32."""
    block = _moe_block("gpt_oss", implementation)
    with caplog.at_level(logging.WARNING, logger="uniep"):
        graphs = _compare(block, BF16, "outside", _tokens(1))
    assert counters["uniep"]["moe_router"] == 1 and counters["uniep"]["router_unfused"] == 0
    (router,) = _ops(graphs, "moe_router")
    assert _input_dtype(router) == BF16
    if implementation == "batched_mm":
        assert counters["uniep"]["moe_experts"] == 0 and counters["uniep"]["unfused"] == 1
        assert not _ops(graphs, "moe_experts")
        assert "the up expert bias is float32 while the expert GEMMs run in bfloat16 under autocast(bfloat16)" \
            in caplog.text
    else:
        assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["unfused"] == 0
        (experts,) = _ops(graphs, "moe_experts")
        assert _input_dtype(experts) == torch.float32


def test_deepseek_sigmoid_router_under_autocast_inside():
    """DeepSeek-V3 casts hidden and weight to fp32 for its router linear; autocast casts them down again
    (linear is on its list), so the logits are bf16: the op reads them cast to bf16, not in fp32."""
    block = _moe_block("deepseek_v3", "grouped_mm")
    graphs = _compare(block, BF16, "inside", _tokens(2))
    assert counters["uniep"]["moe_router"] == 1 and counters["uniep"]["router_unfused"] == 0
    assert counters["uniep"]["moe_experts"] == 1
    (router,) = _ops(graphs, "moe_router")
    assert _input_dtype(router) == BF16


def test_autocast_around_a_checkpoint_body():
    """Autocast entered in the outer graph around a checkpoint call: the body holds no autocast nodes, its
    example values still show the bf16 GEMMs; the op in the body runs in bf16."""
    block = _moe_block("qwen3_moe", "batched_mm")

    def run(x):
        with torch.autocast("cpu", dtype=BF16):
            return checkpoint(block, x, use_reentrant=False)

    graphs = _compare(block, BF16, "inside", _tokens(3), compile_fn=run)
    (experts,) = _ops(graphs, "moe_experts")
    assert counters["uniep"]["unfused"] == 0
    assert [_input_dtype(experts, i) for i in (0, 3, 4)] == [BF16] * 3


def test_autocast_disabled_inside_runs_fp32():
    """autocast(enabled=False) nested inside an autocast region: the block runs in fp32, and so does the op."""
    block = _moe_block("qwen3_moe", "batched_mm")

    def run(x):
        with torch.autocast("cpu", dtype=BF16):
            with torch.autocast("cpu", enabled=False):
                return block(x)

    graphs = _compare(block, torch.float32, "inside", _tokens(4), compile_fn=run)
    (experts,) = _ops(graphs, "moe_experts")
    assert _input_dtype(experts) == torch.float32
    (router,) = _ops(graphs, "moe_router")
    assert _input_dtype(router) == torch.float32


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_graph_run_eagerly_under_autocast_keeps_the_ops_dtypes(implementation):
    """A rewritten graph run eagerly (inner_backend="eager") under a live fp16 autocast: the graph casts the ops'
    inputs where eager's autocast would, and the ops compute in those dtypes, so the matmuls inside an op are not
    recast (before, the reference op's fp32 expert GEMMs of grouped_mm experts ran fp16: 5e-4 off eager). Output and
    every gradient within fp32's tolerance of eager's."""
    block = _moe_block("qwen3_moe", implementation)
    compiled = torch.compile(block, backend="uniep", options={"inner_backend": "eager"})
    with torch.autocast("cpu", dtype=FP16):
        out, grads = _run(block, block, _tokens(5))
        c_out, c_grads = _run(compiled, block, _tokens(5))
    assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["moe_router"] == 1
    assert c_out.dtype == out.dtype and c_grads.keys() == grads.keys()
    tolerance = TOLERANCE[torch.float32] if implementation == "grouped_mm" else TOLERANCE[FP16]
    assert max_rel_err(c_out, out) <= tolerance
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= tolerance, name


def test_whole_model_loss_under_bf16_autocast():
    """The reported recipe: a tiny fp32 Qwen3-MoE with batched_mm experts trained under CPU bf16 autocast.
    Loss, logits and every parameter gradient match eager under the same autocast."""
    model = build_model("qwen3_moe", torch.float32, "batched_mm")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(5))
    graphs = []
    compiled = _compile(model, graphs)
    results = []
    for run in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            out = run(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(),
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, logits, grads), (c_loss, c_logits, c_grads) = results
    assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["moe_router"] == 2
    assert all(_input_dtype(call) == BF16 for call in _ops(graphs, "moe_experts"))
    assert max_rel_err(c_loss, loss) <= TOLERANCE[BF16]
    assert max_rel_err(c_logits, logits) <= TOLERANCE[BF16]
    assert c_grads.keys() == grads.keys()
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= TOLERANCE[BF16], name


def _eager_gemm_dtypes(fn, x):
    """The dtypes eager's expert GEMMs (bmm, _grouped_mm, HF's grouped_mm_fallback) compute in, as dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "bmm" in name or "grouped_mm" in name:
                seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        fn(x)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gpu_cuda_autocast_runs_in_eager_dtypes(family, implementation, caplog):
    """CUDA autocast (bf16) around an fp32 block: CUDA's policy differs from the CPU's (softmax, sum and exp run
    in fp32; bmm and linear in bf16). Either the op computes in the dtype eager's expert GEMMs ran in, with
    outputs and gradients within bf16 tolerance of eager's, or the region runs unfused with the reason logged."""
    block = _moe_block(family, implementation).cuda()
    x = _tokens(6).cuda()

    def under_autocast(v):
        with torch.autocast("cuda", dtype=BF16):
            return block(v)

    eager_dtypes = _eager_gemm_dtypes(under_autocast, x)
    graphs = []
    compiled = _compile(block, graphs)
    with caplog.at_level(logging.WARNING, logger="uniep"), torch.autocast("cuda", dtype=BF16):
        out, grads = _run(block, block, x)
        c_out, c_grads = _run(compiled, block, x)
    assert max_rel_err(c_out, out) <= TOLERANCE[BF16]
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= TOLERANCE[BF16], name
    calls = _ops(graphs, "moe_experts")
    assert len(calls) + counters["uniep"]["unfused"] == 1, caplog.text
    if calls:
        assert {_input_dtype(calls[0], i) for i in (0, 3, 4)} == eager_dtypes, (eager_dtypes, caplog.text)
    else:
        assert "runs unfused" in caplog.text
