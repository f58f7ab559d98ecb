"""The backend as users meet it: entry point, options, counters."""
import importlib.metadata
import operator

import pytest
import torch

import uniep_dynamo
from uniep_dynamo.backend import UniepOptions


def test_entry_point_names_the_backend():
    entry_points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    found = [ep for ep in entry_points if ep.name == "uniep"]
    assert found, "pip install -e . registers the torch_dynamo_backends entry point"
    assert found[0].load() is uniep_dynamo.uniep_backend


def test_backend_is_found_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("uniep") is uniep_dynamo.uniep_backend


def test_unknown_option_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['inner'\]; known options are"):
        UniepOptions.from_options({"inner": "eager"})
    with pytest.raises(ValueError, match="inner_backend 'tvm' is not one of"):
        UniepOptions.from_options({"inner_backend": "tvm"})


def test_rewrite_can_be_switched_off():
    from test_patterns import GraphCapture, HandWrittenExperts, routed

    capture = GraphCapture()
    torch.manual_seed(0)
    module = HandWrittenExperts()
    torch.compile(module, backend="uniep", options={"inner_backend": capture, "rewrite_experts": False})(*routed())
    assert torch.ops.uniep.moe_experts.default not in capture.targets()


def test_tensorrt_without_torch_tensorrt_says_what_to_install():
    pytest.importorskip("transformers")
    try:
        import torch_tensorrt  # noqa: F401
        pytest.skip("torch_tensorrt is installed here; this checks the message without it")
    except ImportError:
        pass
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="needs torch_tensorrt installed"):
        torch.compile(model, backend="uniep", options={"inner_backend": "tensorrt"})(torch.randn(2, 4))


@pytest.mark.parametrize("reuse", [True, False])
def test_reuse_saved_buffers_option_picks_the_backward_op(reuse):
    """reuse_saved_buffers (default True) lowers to the in-place backward, then the combine of the
    input-gradient rows it left in the saved ``down``: a second op, ordered after the first by one of its
    outputs, that no longer reads ``up`` (so a compiled backward frees it first). The writes are not in the
    schema (no auto-functionalization, whose copies of the saved buffers inductor could not remove); the op
    records the buffers it overwrote, so a second backward through the graph (retain_graph) raises, naming the
    option. False keeps the out-of-place op, and a second backward adds up the same gradients again."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from test_patterns import HandWrittenExperts, routed
    from uniep_dynamo.report import uniep_op_of

    backward_targets, backward_nodes = [], []

    def fw(gm, _):
        return make_boxed_func(gm.forward)

    def bw(gm, _):
        backward_nodes.extend(gm.graph.nodes)
        backward_targets.extend((uniep_op_of(n), str(n.args[0]) if "auto_functionalized" in str(n.target) else str(n.target))
                                for n in gm.graph.nodes if uniep_op_of(n))
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()
    x.requires_grad_()
    options = {"inner_backend": aot_autograd(fw_compiler=fw, bw_compiler=bw), "reuse_saved_buffers": reuse}
    out = torch.compile(module, backend="uniep", options=options)(x, ids, w)
    out.sum().backward(retain_graph=True)
    assert [name for name, _ in backward_targets] == ["moe_experts_backward"] + ["moe_experts_backward_combine"] * reuse
    assert backward_targets[0][1].endswith("moe_experts_backward_.default") == reuse
    assert not any("auto_functionalized" in str(n.target) or n.target is torch.ops.aten.copy_.default
                   for n in backward_nodes)
    if reuse:  # the combine reads the saved `down` after the backward op: one of that op's outputs is an input
        (backward_node,) = [n for n in backward_nodes if uniep_op_of(n) == "moe_experts_backward"]
        (combine_node,) = [n for n in backward_nodes if uniep_op_of(n) == "moe_experts_backward_combine"]
        after = combine_node.args[1]
        assert after.target is operator.getitem and after.args[0] is backward_node
        up, down = backward_node.args[12:14]
        assert combine_node.args[0] is down and up not in combine_node.all_input_nodes
        with pytest.raises(RuntimeError, match="uniep: a second backward .*reuse_saved_buffers"):
            out.sum().backward()
    if not reuse:
        first = x.grad.clone()
        out.sum().backward()
        assert torch.equal(x.grad, 2 * first)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_block_run_twice_on_one_input_takes_one_backward(inner):
    """The same experts run twice on the same input in one compiled step, their outputs used differently (a
    consistency loss over two passes of one batch), then one backward: two experts ops, each with its own saved
    buffers (ExpertsSpec.site). Before, the graph's common-subexpression elimination merged the two identical
    forward calls, and the second in-place backward refused the buffers the first had overwritten, as if it were a
    second backward. Output and gradients are eager's."""
    from test_patterns import HandWrittenExperts, routed

    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()

    def step(x):
        return module(x, ids, w) * module(x, ids, w).tanh()

    results = []
    for fn in (step, torch.compile(step, backend="uniep", options={"inner_backend": inner})):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with uniep_dynamo.recording() as report:
            out = fn(xi)
        out.square().sum().backward()
        results.append([out.detach(), xi.grad] + [p.grad for p in module.parameters()])
    assert report.totals()["moe_experts"] == 2
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_late_routing_weight_compiled_keeps_no_down_rows(monkeypatch):
    """Compiled with the late_routing_weight knob on (UNIEP_LATE_ROUTING_WEIGHT=1, the fused kernels in Triton's
    interpreter), the backward graph receives no [rows, H] down rows from the forward, in place (the default) and not;
    the in-place backward hands the input-gradient rows it allocated to the combine; the gradients of the two
    compiles are equal bit for bit, and the hand-written module's within tolerance."""
    pytest.importorskip("triton", reason="the fused kernels run in Triton's interpreter here")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from test_patterns import I, HandWrittenExperts, routed
    from uniep_dynamo.report import uniep_op_of

    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    monkeypatch.setenv("UNIEP_LATE_ROUTING_WEIGHT", "1")
    inputs, nodes = [], []

    def fw(gm, _):
        return make_boxed_func(gm.forward)

    def bw(gm, _):
        inputs.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder")
        nodes.extend(gm.graph.nodes)
        return make_boxed_func(gm.forward)

    reuse = True  # the in-place backward (the default), then the out-of-place one for its bits
    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()
    options = {"inner_backend": aot_autograd(fw_compiler=fw, bw_compiler=bw), "reuse_saved_buffers": reuse}
    torch.compile(module, backend="uniep", options=options)(x, ids, w).sum().backward()
    rows = ids.numel()
    # of the [rows, *] tensors only the up projection ([rows, 2I]; here 2I = H) comes from the forward
    assert [s for s in inputs if len(s) == 2 and s[0] == rows] == [(rows, 2 * I)], inputs
    (backward_node,) = [n for n in nodes if uniep_op_of(n) == "moe_experts_backward"]
    (combine_node,) = [n for n in nodes if uniep_op_of(n) == "moe_experts_backward_combine"]
    assert combine_node.args[0].target is operator.getitem and combine_node.args[0].args == (backward_node, 5)
    inputs.clear()
    grads = [t.grad.clone() for t in (x, w, module.gate_up_proj, module.down_proj)]
    for t in (x, w, module.gate_up_proj, module.down_proj):
        t.grad = None
    torch._dynamo.reset()
    other = {**options, "reuse_saved_buffers": not reuse}
    torch.compile(module, backend="uniep", options=other)(x, ids, w).sum().backward()
    assert [s for s in inputs if len(s) == 2 and s[0] == rows] == [(rows, 2 * I)], inputs
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, (x, w, module.gate_up_proj, module.down_proj)))
    for t in (x, w, module.gate_up_proj, module.down_proj):
        t.grad = None
    module(x, ids, w).sum().backward()
    for a, b in zip(grads, (x, w, module.gate_up_proj, module.down_proj)):
        assert torch.allclose(a, b.grad, rtol=1e-4, atol=1e-5)


def test_inductor_caches_key_on_uniep_sources(monkeypatch):
    """Inductor's FX-graph and AOTAutograd caches do not look at a custom op's fake implementation. The backend
    adds uniep's source hash to their keys (a no-op post-grad pass's uuid), so a graph compiled by another
    uniep (its ops' output shapes may differ under the same schema) is compiled again, not served stale; and the
    settings read while AOTAutograd traces (UNIEP_LATE_ROUTING_WEIGHT: whether the backward keeps the down rows)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache
    from test_patterns import HandWrittenExperts, routed

    from uniep_dynamo import backend

    assert backend.source_hash() == backend.source_hash() and len(backend.source_hash()) == 64
    torch.manual_seed(0)
    module, args = HandWrittenExperts(), routed()
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True), torch.no_grad():
        for salt, late, served in (("first", "0", False), ("first", "0", True), ("second", "0", False),
                                   ("second", "1", False), ("second", "1", True)):
            monkeypatch.setattr(backend, "source_hash", lambda salt=salt: salt)
            monkeypatch.setenv("UNIEP_LATE_ROUTING_WEIGHT", late)
            torch._dynamo.reset()
            counters.clear()
            torch.compile(module, backend="uniep")(*args)
            assert counters["uniep"]["moe_experts"] == 1
            hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
            assert (hits > 0) == served, (salt, late, dict(counters["inductor"]), dict(counters["aot_autograd"]))
