"""Rewrites inside higher-order-op bodies: activation checkpointing (HF's and torch.utils.checkpoint, reentrant
or not, selective policies) and nested compile regions. Each case asserts that the rewrite fired in the body,
that the op is recomputed in the backward rather than its outputs saved, and that loss and every gradient
match eager with the same checkpointing."""
import functools
import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import uniep_dynamo  # noqa: F401
from conftest import TOLERANCE, max_rel_err
from hf_models import build_model
from test_models import loss_and_grads
from uniep_dynamo import checkpoint_effects, report


def _compare(model, ids, compiled):
    loss, logits, grads = loss_and_grads(model, ids)
    c_loss, c_logits, c_grads = loss_and_grads(model, ids, compiled)
    assert max_rel_err(c_loss, loss) <= TOLERANCE[torch.float32]
    assert max_rel_err(c_logits, logits) <= TOLERANCE[torch.float32]
    assert c_grads.keys() == grads.keys()
    for name in grads:
        assert max_rel_err(c_grads[name], grads[name]) <= 1e-4, name
    return c_loss, c_grads


@pytest.mark.parametrize("family,reentrant,router_logits", [
    ("qwen3_moe", False, False),  # HF's default: non-reentrant torch.utils.checkpoint per decoder layer
    ("qwen3_moe", True, False),  # reentrant: Dynamo turns it into the same tag_activation_checkpoint body
    ("mixtral", False, False),
    # the auxiliary loss: HF's output capture appends each layer's router logits to the step's list from inside
    # the body (a side effect, traced in uniep's compiles: checkpoint_effects.py)
    ("qwen3_moe", False, True),
])
def test_hf_gradient_checkpointing_rewrites_inside_the_body(family, reentrant, router_logits):
    model = build_model(family)
    if router_logits:
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.config.use_cache = False
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})
    with report.recording() as rec:
        c_loss, c_grads = _compare(model, ids, compiled)
    assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["moe_router"] == 2
    assert counters["uniep"]["unfused"] == 0 and counters["uniep"]["router_unfused"] == 0
    rewrites = [r for g in rec.graphs for r in g.rewrites]
    assert len(rewrites) == 4 and all(r.graph.startswith("wrap_body_") for r in rewrites), rewrites
    graph = next(g for g in rec.graphs if g.rewrites)
    # Each layer's op sits in its checkpoint body: the forward runs it, and the backward recomputes it
    # (the partitioner saves the layer's inputs, not the op's projections) before running its backward.
    assert graph.aot_graphs["forward"].get("moe_experts") == 2
    assert graph.aot_graphs["backward"].get("moe_experts") == 2
    assert graph.aot_graphs["backward"].get("moe_experts_backward") == 2
    assert not graph.coverage_gaps()
    # the recomputed forward gives the same bits: a second step is bitwise the first
    again = loss_and_grads(model, ids, compiled)
    assert torch.equal(again[0], c_loss)
    for name in c_grads:
        assert torch.equal(again[2][name], c_grads[name]), name


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("wrap", ["checkpoint", "selective_checkpoint", "nested_compile_region"])
def test_block_under_checkpoint_or_nested_region(wrap):
    """torch.utils.checkpoint around one MoE block, plain or with a selective policy (matmuls saved, the rest,
    the uniep ops among it, recomputed), and torch.compiler.nested_compile_region (invoke_subgraph, one body
    that two calls share)."""
    model = build_model("qwen3_moe")
    block = model.model.layers[0].mlp
    if wrap == "nested_compile_region":
        region = torch.compiler.nested_compile_region(lambda x: block(x))

        def run(x):
            return region(region(x))
    else:
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) \
            if wrap == "selective_checkpoint" else None
        kwargs = {"context_fn": context} if context is not None else {}

        def run(x):
            return checkpoint(block, x, use_reentrant=False, **kwargs)

    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(run, backend="uniep", options={"inner_backend": "aot_eager"})
    results = []
    with report.recording() as rec:
        for fn in (run, compiled, compiled):
            model.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            out = fn(xx)
            out.square().sum().backward()
            results.append((out.detach(), xx.grad, {n: p.grad for n, p in block.named_parameters()}))
    eager, first, second = results
    assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["moe_router"] == 1
    # the report finds the ops in the AOT graphs, a nested compile region's shared body (a subgraph module) included
    (graph,) = [g for g in rec.graphs if g.rewrites]
    assert graph.aot_graphs["forward"].get("moe_experts", 0) >= 1, graph.aot_graphs
    assert graph.aot_graphs["backward"].get("moe_experts_backward", 0) >= 1, graph.aot_graphs
    assert not graph.coverage_gaps(), graph.coverage_gaps()
    for i in (0, 1):
        assert max_rel_err(first[i], eager[i]) <= TOLERANCE[torch.float32]
        assert torch.equal(first[i], second[i])
    for name in eager[2]:
        assert max_rel_err(first[2][name], eager[2][name]) <= 1e-4, name
        assert torch.equal(first[2][name], second[2][name]), name


class _Switch:
    """A context variable's stand-in that compiles as a plain attribute (kernels' and transformers'
    CompileableContextVar): set before the call, reset after it."""
    value = None


_SWITCH = _Switch()


@pytest.mark.parametrize("backend,options,fused", [
    ("uniep", {"inner_backend": "aot_eager"}, True),  # traced: the side effect applied once, in the forward
    ("uniep", {"inner_backend": "aot_eager", "trace_checkpoint_side_effects": False}, False),  # Dynamo's break
    ("aot_eager", None, False),  # another backend's compile sees Dynamo's setting as it is: the break stays
])
def test_side_effects_in_a_checkpoint_body(backend, options, fused, caplog):
    """A checkpointed layer that writes an object from outside its body (every HF decoder layer since transformers
    5.25: the kernels package's context variable around the attention; the router logits appended to the step's
    list) breaks Dynamo's graph, and the checkpoint runs eagerly, unfused. In uniep's compiles it is traced with
    the write applied once: the rewrite fires inside the body, the write is seen after the step, and loss and
    gradients equal eager's. Other compiles, and uniep's with the option off, keep the break."""
    model = build_model("qwen3_moe")
    block = model.model.layers[0].mlp
    seen = []

    def layer(x):
        _SWITCH.value = "fused kernels"
        try:
            out = block(x)
            seen.append(out.shape[-1])  # the output capture's append
            return out
        finally:
            _SWITCH.value = None

    def run(x):
        return checkpoint(layer, x, use_reentrant=False)

    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = run(eager_x)
    eager.square().sum().backward()
    eager_grads = {n: p.grad for n, p in block.named_parameters()}
    model.zero_grad(set_to_none=True)
    seen.clear()
    breaks_before = sum(counters["graph_break"].values())
    compiled = torch.compile(run, backend=backend, options=options)
    checkpoint_effects._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="uniep"):
        out = compiled(compiled_x)
    out.square().sum().backward()
    assert counters["uniep"]["moe_experts"] == int(fused) and counters["uniep"]["moe_router"] == int(fused)
    # a uniep compile that leaves the checkpoint to eager says so (its layers are in no graph the report sees)
    eager_warnings = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(eager_warnings) == (backend == "uniep" and not fused), eager_warnings
    if eager_warnings:
        assert "Unsafe side effect" in eager_warnings[0] and "no MoE layer inside it is fused" in eager_warnings[0]
    assert (sum(counters["graph_break"].values()) == breaks_before) == fused, dict(counters["graph_break"])
    assert _SWITCH.value is None and seen and seen[0] == 32
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False
    assert max_rel_err(out, eager) <= TOLERANCE[torch.float32]
    assert max_rel_err(compiled_x.grad, eager_x.grad) <= 1e-4
    for name, p in block.named_parameters():
        assert max_rel_err(p.grad, eager_grads[name]) <= 1e-4, name


def test_side_effects_in_a_checkpoint_inside_a_nested_region_keep_the_graph_break():
    """A checkpoint whose body writes outside it, inside a nested_compile_region's body (traced once, called three
    times a forward): torch traces such a side effect fewer times than eager runs it (or its compile fails, with a
    tensor appended), so uniep leaves Dynamo's graph break there; the writes are eager's, three a forward."""
    layer = torch.nn.Linear(8, 8)
    log = []

    def body(h):
        log.append("layer")
        return torch.tanh(layer(h))

    @torch.compiler.nested_compile_region
    def block(h):
        return checkpoint(body, h, use_reentrant=False)

    def run(x):
        return block(block(block(x))).sum()

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    compiled = torch.compile(run, backend="uniep", options={"inner_backend": "aot_eager"})
    for _ in range(2):  # the first call compiles, the second runs what it made
        log.clear()
        out = compiled(x)
        assert len(log) == 3, log
    assert torch.equal(out, run(x))


def test_weights_passed_into_a_body_as_plain_tensors_rewrite():
    """Inside a checkpoint's body every input is a placeholder. Expert weights passed in as plain tensors (no
    parameters: a functional call's) are rewritten as parameters are, and their gradients flow out of the body."""
    model = build_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach().clone().requires_grad_()
    down = experts.down_proj.detach().clone().requires_grad_()

    def layer(x, ids, w, gate_up, down):
        with torch.nn.utils.stateless._reparametrize_module(experts, {"gate_up_proj": gate_up, "down_proj": down}):
            return experts(x, ids, w)

    def run(x, ids, w):
        return checkpoint(layer, x, ids, w, gate_up, down, use_reentrant=False)

    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(5))
    w = torch.rand(10, 2, generator=torch.Generator().manual_seed(6))
    w.requires_grad_()
    eager = run(x, ids, w)
    eager_grads = torch.autograd.grad(eager.sum(), (w, gate_up, down))
    compiled = torch.compile(run, backend="uniep", options={"inner_backend": "eager"})
    out = compiled(x, ids, w)
    grads = torch.autograd.grad(out.sum(), (w, gate_up, down))
    assert counters["uniep"]["moe_experts"] == 1 and counters["uniep"]["unfused"] == 0
    assert max_rel_err(out, eager) <= TOLERANCE[torch.float32]
    for got, want in zip(grads, eager_grads):
        assert max_rel_err(got, want) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gpu_bf16_checkpointing_recomputes_the_same_bits(family):
    """On CUDA in bf16 the op runs the MegaKernel. Recomputed under checkpointing it gives the bits it gave in the
    forward: loss and every gradient equal the same compile without checkpointing bit for bit (aot_eager, so the
    rest of the graph runs the same kernels either way)."""
    results = []
    for checkpointing in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = build_model(family, dtype=torch.bfloat16).cuda()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(7)).cuda()
        compiled = torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})
        results.append(loss_and_grads(model, ids, compiled))
        assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["moe_router"] == 2
    plain, checkpointed = results
    assert torch.equal(plain[0], checkpointed[0]) and torch.equal(plain[1], checkpointed[1])
    for name in plain[2]:
        assert torch.equal(plain[2][name], checkpointed[2][name]), name
