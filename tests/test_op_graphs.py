"""The experts op's CUDA graphs for small inference calls (kernels/op_graphs.py): which ops the backend marks for them
(CPU), and what the op then returns. The replay itself needs a GPU: tests/test_gpu.py."""
from __future__ import annotations

import dataclasses
import operator

import pytest
import torch

from hf_models import build_model
from uniep_dynamo.backend import mark_inference
from uniep_dynamo.kernels import op_graphs
from uniep_dynamo.spec import decode_router_spec, decode_spec


def _compiled(model):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(model, backend="uniep", options={"inner_backend": keep}), graphs


def _experts_specs(graphs):
    return [decode_spec(n.args[8]) for gm in graphs for n in gm.graph.nodes
            if n.target is torch.ops.uniep.moe_experts.default]


@pytest.mark.parametrize("grad", [False, True])
def test_only_graphs_that_take_no_gradient_mark_the_experts_ops(grad):
    """Under no_grad every experts op of the graph is marked (its graph reads only the op's output); with gradients
    none is, so that the op's saved buffers stay real. Either way the output is eager's."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    compiled, graphs = _compiled(model)
    with torch.set_grad_enabled(grad):
        logits = compiled(ids).logits
    specs = _experts_specs(graphs)
    assert len(specs) == 2
    assert all(s.inference is (not grad) for s in specs)
    # a decode-sized marked op builds its routing plan inside its own CUDA graph; with gradients the router's is shared
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.uniep.moe_experts.default]
    routers = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.uniep.moe_router.default]
    assert len(routers) == 2
    assert all(("plan_row_order" in n.kwargs) is grad for n in calls)
    assert all(decode_router_spec(n.args[4]).plan is grad for n in routers)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    if grad:
        logits.sum().backward()  # the marked-free graph's backward runs
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_an_op_whose_other_outputs_are_read_is_not_marked():
    """mark_inference proves its condition: an op whose up projection (output 4) the graph reads keeps its spec."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    compiled, graphs = _compiled(model)
    with torch.no_grad():
        compiled(torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1)))
    gm = graphs[0]
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.uniep.moe_experts.default]
    for n in calls:  # unmarked again
        n.args = n.args[:8] + (dataclasses.replace(decode_spec(n.args[8]), inference=False).encode(),) + n.args[9:]
    with gm.graph.inserting_after(calls[0]):
        extra = gm.graph.call_function(operator.getitem, (calls[0], 4))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (tuple(output.args[0]) + (extra,),)
    assert mark_inference(gm) == len(calls) - 1
    assert [decode_spec(n.args[8]).inference for n in calls] == [False] + [True] * (len(calls) - 1)


def test_ops_past_the_graphs_slot_limit_keep_the_routers_plan(monkeypatch):
    """A marked op with more routed slots than op_graphs.MAX_SLOTS (served without a graph) keeps the plan the router
    op builds in its select pass."""
    torch._dynamo.reset()
    monkeypatch.setattr(op_graphs, "MAX_SLOTS", 8)
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = model(ids).logits
    compiled, graphs = _compiled(model)
    with torch.no_grad():
        logits = compiled(ids).logits
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.uniep.moe_experts.default]
    assert calls and all(decode_spec(n.args[8]).inference and "plan_row_order" in n.kwargs for n in calls)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_the_spec_flag_round_trips_and_leaves_old_specs_alone():
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), torch.float32)
    assert "inference" not in spec.encode()
    marked = ExpertsSpec("oi", "oi", spec.gate, torch.float32, inference=True)
    assert decode_spec(marked.encode()) == marked and decode_spec(spec.encode()) == spec


def test_cpu_calls_run_the_op_as_before():
    """On CPU (the reference) the flag changes nothing: no graph is made, and the op's outputs keep their values."""
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    g = torch.Generator().manual_seed(2)
    T, H, I, E, K = 6, 16, 8, 4, 2
    hidden = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    w_up, w_down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    gate = encode("chunk", SILU_GLU_EXPR)
    plain = ExpertsSpec("oi", "oi", gate, torch.float32).encode()
    marked = ExpertsSpec("oi", "oi", gate, torch.float32, inference=True).encode()
    before = dict(op_graphs.counts)
    with torch.no_grad():
        a = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain)
        b = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert op_graphs.counts == before


def test_the_report_says_what_an_inference_graph_runs():
    """uniep's report (explain, uniep-diff) of an inference graph: the experts rewrite says its small calls replay the
    op's CUDA graph, and the router's no longer claims the routing plan it stopped building."""
    from uniep_dynamo.report import recording

    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    with recording() as recorder, torch.no_grad():
        torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})(
            torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(4)))
    rewrites = recorder.to_dict()["graphs"][0]["rewrites"]
    experts = [r["spec"] for r in rewrites if r["op"] == "moe_experts"]
    routers = [r["spec"] for r in rewrites if r["op"] == "moe_router"]
    assert len(experts) == len(routers) == 2
    assert all("CUDA graph" in spec for spec in experts)
    assert not any("routing plan" in spec for spec in routers)
