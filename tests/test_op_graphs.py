"""The experts op's CUDA graphs for small inference calls (kernels/op_graphs.py): which ops the backend marks for them
(CPU), and what the op then returns. The replay itself needs a GPU: tests/test_gpu.py."""
from __future__ import annotations

import contextlib
import operator

import pytest
import torch

from hf_models import build_model
from uniep_dynamo.backend import mark_inference
from uniep_dynamo.kernels import op_graphs
from uniep_dynamo.spec import decode_router_spec, decode_spec


def _compiled(model, **compile_kwargs):
    graphs = []

    def keep(gm, example_inputs):
        gm.meta["test_inputs"] = list(example_inputs)
        graphs.append(gm)
        return gm.forward

    return torch.compile(model, backend="uniep", options={"inner_backend": keep}, **compile_kwargs), graphs


def _op_nodes(graphs, op):
    return [n for gm in graphs for n in gm.graph.nodes if n.target is op]


def _experts_specs(graphs):
    return [decode_spec(n.args[8]) for n in _op_nodes(graphs, torch.ops.uniep.moe_experts.default)]


def _blocks(graphs):
    return _op_nodes(graphs, torch.ops.uniep.moe_block.default)


@pytest.mark.parametrize("grad", [False, True])
def test_only_graphs_that_take_no_gradient_mark_the_experts_ops(grad):
    """Under no_grad every experts op of the graph is marked (its graph reads only the op's output) and, its router op
    feeding it alone, fused with it into one uniep.moe_block whose router builds no plan (the experts' graph builds
    it); with gradients none is, so that the op's saved buffers stay real, and the router's plan is shared. Either
    way the output is eager's."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    compiled, graphs = _compiled(model)
    with torch.set_grad_enabled(grad):
        logits = compiled(ids).logits
    calls = _op_nodes(graphs, torch.ops.uniep.moe_experts.default)
    routers = _op_nodes(graphs, torch.ops.uniep.moe_router.default)
    blocks = _blocks(graphs)
    if grad:
        assert len(calls) == len(routers) == 2 and not blocks
        assert not any(s.inference for s in _experts_specs(graphs))
        assert all("plan_row_order" in n.kwargs for n in calls)
        assert all(decode_router_spec(n.args[4]).plan for n in routers)
    else:
        assert len(blocks) == 2 and not calls and not routers
        assert all(decode_spec(n.args[10]).inference and not decode_router_spec(n.args[4]).plan for n in blocks)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    if grad:
        logits.sum().backward()  # the marked-free graph's backward runs
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def _unmarked_graph(monkeypatch, seed=1):
    """A no_grad graph of the tiny Qwen3-MoE as the backend leaves it before mark_inference."""
    from uniep_dynamo import backend

    torch._dynamo.reset()
    monkeypatch.setattr(backend, "mark_inference", lambda gm, nodes=None: 0)
    model = build_model("qwen3_moe")
    compiled, graphs = _compiled(model)
    with torch.no_grad():
        compiled(torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(seed)))
    monkeypatch.undo()
    return graphs[0]


def _add_output(gm, node, index):
    with gm.graph.inserting_after(node):
        extra = gm.graph.call_function(operator.getitem, (node, index))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (tuple(output.args[0]) + (extra,),)


def test_an_op_whose_other_outputs_are_read_is_not_marked(monkeypatch):
    """mark_inference proves its condition: an op whose up projection (output 4) the graph reads keeps its spec."""
    gm = _unmarked_graph(monkeypatch)
    calls = _op_nodes([gm], torch.ops.uniep.moe_experts.default)
    _add_output(gm, calls[0], 4)
    gm.recompile()
    with torch.no_grad():
        expected = gm(*gm.meta["test_inputs"])
    assert mark_inference(gm) == len(calls) - 1
    with torch.no_grad():  # the fused layer's output is the two ops' (the same reference path on CPU)
        got = gm(*gm.meta["test_inputs"])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    calls = _op_nodes([gm], torch.ops.uniep.moe_experts.default)
    assert len(calls) == 1 and not decode_spec(calls[0].args[8]).inference
    assert len(_blocks([gm])) == 1  # the other layer's, marked and fused


@pytest.mark.parametrize("read", ["logits", "weights"])
def test_a_router_op_read_by_another_node_is_not_fused(monkeypatch, read):
    """_fuse_block proves its condition: where the graph reads the router's logits or its routing weights besides the
    experts op, both ops stay (the experts op marked), and the graph's outputs are the unfused graph's."""
    gm = _unmarked_graph(monkeypatch, seed=2)
    routers = _op_nodes([gm], torch.ops.uniep.moe_router.default)
    _add_output(gm, routers[0], {"logits": 0, "weights": 1}[read])
    gm.recompile()
    with torch.no_grad():
        expected = gm(*gm.meta["test_inputs"])
    assert mark_inference(gm) == 2
    with torch.no_grad():
        got = gm(*gm.meta["test_inputs"])
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert len(_blocks([gm])) == 1
    assert len(_op_nodes([gm], torch.ops.uniep.moe_router.default)) == 1
    left = _op_nodes([gm], torch.ops.uniep.moe_experts.default)
    assert len(left) == 1 and decode_spec(left[0].args[8]).inference


def test_ops_past_the_graphs_slot_limit_keep_the_routers_plan(monkeypatch):
    """A marked op with more routed slots than op_graphs.MAX_SLOTS (served without a graph) keeps the plan the router
    op builds in its select pass: fused with its router, the block's router builds it and its experts take it."""
    torch._dynamo.reset()
    monkeypatch.setattr(op_graphs, "MAX_SLOTS", 8)
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = model(ids).logits
    compiled, graphs = _compiled(model)
    with torch.no_grad():
        logits = compiled(ids).logits
    blocks = _blocks(graphs)
    assert len(blocks) == 2 and not _op_nodes(graphs, torch.ops.uniep.moe_experts.default)
    assert all(decode_spec(n.args[10]).inference and decode_router_spec(n.args[4]).plan for n in blocks)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_a_block_under_dynamic_shapes_keeps_the_routers_plan():
    """Under dynamic=True the slot count is symbolic: the block's router builds the plan (as the two ops shared it),
    and two token counts through the one graph give eager's outputs."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    compiled, graphs = _compiled(model, dynamic=True)
    for length in (5, 9):
        ids = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    blocks = _blocks(graphs)
    assert len(graphs) == 1 and len(blocks) == 2
    assert all(decode_router_spec(n.args[4]).plan for n in blocks)


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


# -- the graphs' bookkeeping on CPU: CUDA's graph, streams and the kernels stood in for --------------------------------
# kernels/op_graphs.py as it runs on a GPU, with torch.cuda's CUDAGraph and streams replaced by fakes and
# megakernel.experts_forward by a stand-in whose "capture" records its call and whose "replay" computes it again from
# the graph's input buffers into its output buffers: what CUDA's graphs do, for the module's keys, copies, refusals and
# eviction. The real graphs are tests/test_gpu.py's.


class _FakeStream:
    def __init__(self, stream_id=0):
        self.stream_id = stream_id

    def wait_stream(self, other):
        pass


class _FakeGraph:
    capturing = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        _FakeGraph.capturing, self.calls, self.pool = self, [], pool

    def capture_end(self):
        _FakeGraph.capturing = None

    def replay(self):  # each recorded call again, in order, into its recorded outputs (a later one reads them)
        for fn, args, kwargs, outputs in self.calls:
            for static, value in zip(outputs, fn(*args, **kwargs)):
                static.copy_(value)


def _stand_in_kernels(hidden, ids, weights, w_up, w_down, b_up, b_down, spec, plan=None, config=None):
    """A deterministic function of every input the graph copies in and of the weights it reads in place."""
    rows = ids.numel()
    out = hidden * weights.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True) + w_up.sum() - w_down.sum()
    if plan is not None:
        out = out + plan[2].sum()
    return (out, ids.new_zeros(rows), ids.new_zeros(rows), ids.new_zeros(w_up.shape[0]),
            hidden.new_zeros(rows, w_up.shape[1]), hidden.new_zeros(rows, hidden.shape[1]))


def _stand_in_router(hidden, weight, bias, score_bias, spec):
    """(logits, weights, ids): a deterministic function of the hidden states and the router weight."""
    logits = hidden @ weight.t()
    weights, ids = logits.softmax(-1).topk(spec.top_k, dim=-1)
    return logits, weights, ids


@pytest.fixture
def fake_cuda(monkeypatch):
    """op_graphs with fake CUDA graphs and streams, a clean state, and the stand-in kernels; yields a setter of the
    current stream's id and a switch that makes the next capture raise."""
    from uniep_dynamo.kernels import megakernel, triton_router

    state = {"stream": 0, "fail": False, "unfused": False}

    def recorded(fn):
        def call(*args, **kwargs):
            if state["fail"] and _FakeGraph.capturing is not None:
                raise RuntimeError("operation not permitted when stream is capturing")
            outputs = fn(*args, **kwargs)
            if _FakeGraph.capturing is not None:
                _FakeGraph.capturing.calls.append((fn, args, kwargs, outputs))
            return outputs
        return call

    monkeypatch.setattr(megakernel, "experts_forward", recorded(_stand_in_kernels))
    monkeypatch.setattr(triton_router, "router_forward", recorded(_stand_in_router))
    monkeypatch.setattr(op_graphs, "_write", recorded(op_graphs._write))  # the copy into the output buffer
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    # the fused kernels' checks (a block's capture asks them again): they take every call unless told otherwise
    monkeypatch.setattr(megakernel, "unsupported_reason", lambda *a: "unfused" if state["unfused"] else None)
    monkeypatch.setattr(megakernel, "router_unsupported_reason", lambda *a: "unfused" if state["unfused"] else None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(99))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(state["stream"]))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(op_graphs, "_STREAMS", {})
    monkeypatch.setattr(op_graphs, "counts", {"captured": 0, "replayed": 0, "failed": 0})
    op_graphs.clear()
    yield state
    op_graphs.clear()


_WEIGHTS = {}


def _case(seed, T=6, H=8, E=4, K=2, w_up=None):
    """(the op's arguments, a config) for a call of T tokens; the expert weights are the same tensors from call to
    call unless ``w_up`` says otherwise."""
    from uniep_dynamo.kernels import config as kconfig
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    g = torch.Generator().manual_seed(seed)
    hidden, ids = torch.randn(T, H, generator=g), torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    if not _WEIGHTS:
        _WEIGHTS.update(up=torch.ones(E, 2 * 4, H), down=torch.ones(E, H, 4))
    w_up = w_up if w_up is not None else _WEIGHTS["up"]
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), torch.float32, inference=True)
    cfg = kconfig.heuristic_config(T * K, E, H, 4, False)
    return (hidden, ids, weights, w_up, _WEIGHTS["down"], None, None, spec), cfg


def _serve(args, cfg, plan=None):
    return op_graphs._from_graph(*args, plan, cfg)


def test_a_kind_of_call_runs_once_then_is_captured_then_replays_new_inputs(fake_cuda):
    args, cfg = _case(0)
    assert _serve(args, cfg) is None  # the first call of its kind: the caller runs the kernels
    for seed in (0, 1, 2):  # captured on the second call; every call after replays with its own inputs copied in
        args, _ = _case(seed)
        got = _serve(args, cfg)
        expected = _stand_in_kernels(*args)
        assert torch.equal(got[0], expected[0])
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]
        assert got[0].data_ptr() != op_graphs._GRAPHS[next(iter(op_graphs._GRAPHS))].out.data_ptr()
    assert op_graphs.counts["captured"] == 1 and len(op_graphs._GRAPHS) == 1
    entry = next(iter(op_graphs._GRAPHS.values()))
    assert entry.graph.calls[0][2]["config"] is cfg  # the capture ran with its key's config, not a lookup of its own


def test_the_routers_plan_is_copied_in_with_the_activations(fake_cuda):
    args, cfg = _case(3)
    for seed in (3, 4, 5):
        args, _ = _case(seed)
        plan = (torch.arange(12), torch.arange(12), torch.tensor([seed, 1, 2, 3]))
        got = _serve(args, cfg, plan)
        if seed > 3:
            assert torch.equal(got[0], _stand_in_kernels(*args, plan=plan)[0])
            assert got[3] is plan[2]  # the given plan is handed back (the op returns empty tensors in its place)


def test_other_weights_streams_shapes_and_configs_are_other_graphs(fake_cuda):
    import dataclasses

    args, cfg = _case(0)
    variants = [
        (args, cfg),
        ((args[0], args[1], args[2], args[3].clone()) + args[4:], cfg),  # the same values at another address
        (_case(0, T=5)[0], cfg),  # another shape
        (args, dataclasses.replace(cfg, fuse_gather=not cfg.fuse_gather)),  # another config
    ]
    for a, c in variants:
        assert _serve(a, c) is None
        assert torch.equal(_serve(a, c)[0], _stand_in_kernels(*a)[0])
    fake_cuda["stream"] = 7  # another stream: its own graph
    assert _serve(args, cfg) is None and _serve(args, cfg) is not None
    assert op_graphs.counts["captured"] == len(variants) + 1


def test_a_capture_that_fails_leaves_its_kind_of_call_to_the_kernels(fake_cuda, caplog):
    import logging

    args, cfg = _case(0)
    fake_cuda["fail"] = True
    with caplog.at_level(logging.WARNING, logger="uniep"):
        assert _serve(args, cfg) is None and _serve(args, cfg) is None
    assert "could not be captured" in caplog.text
    fake_cuda["fail"] = False
    assert _serve(args, cfg) is None  # refused for good, without another attempt
    assert op_graphs.counts["failed"] == 1 and op_graphs.counts["captured"] == 0 and not op_graphs._GRAPHS


def test_graphs_are_evicted_least_recently_used_first(fake_cuda, monkeypatch):
    monkeypatch.setattr(op_graphs, "MAX_GRAPHS", 2)
    cases = [_case(0, T=t) for t in (3, 4, 5)]
    for args, cfg in cases:
        _serve(args, cfg), _serve(args, cfg)
    assert len(op_graphs._GRAPHS) == 2 and op_graphs.counts["captured"] == 3
    assert [k[6][0][0] for k in op_graphs._GRAPHS] == [(4, 8), (5, 8)]  # T = 3's, the oldest, went first
    _serve(*cases[1])  # T = 4 used again: T = 5's is now the oldest, and the next capture evicts it
    args, cfg = _case(0, T=2)
    _serve(args, cfg), _serve(args, cfg)
    assert [k[6][0][0] for k in op_graphs._GRAPHS] == [(4, 8), (2, 8)]
    # the bytes bound: a graph that fits alone evicts the least recently used others until all fit
    monkeypatch.setattr(op_graphs, "MAX_BYTES", op_graphs._BYTES[0])  # what the two hold: a third's buffers exceed it
    args, cfg = _case(0, T=1)
    _serve(args, cfg), _serve(args, cfg)
    assert [k[6][0][0] for k in op_graphs._GRAPHS] == [(2, 8), (1, 8)]
    assert op_graphs._BYTES[0] == _held() <= op_graphs.MAX_BYTES
    # one that would not fit alone takes no graph and evicts nothing
    monkeypatch.setattr(op_graphs, "MAX_BYTES", 1)
    args, cfg = _case(0, T=7)
    assert _serve(args, cfg) is None and _serve(args, cfg) is None and _serve(args, cfg) is None
    assert [k[6][0][0] for k in op_graphs._GRAPHS] == [(2, 8), (1, 8)] and op_graphs.counts["captured"] == 5


def _held() -> int:
    """What the graphs' shared buffers and pools hold, by the module's estimate."""
    return sum(b.numel() * b.element_size() for b, _ in op_graphs._BUFFERS.values()) + \
        sum(pool.nbytes for pool in op_graphs._POOLS.values())


def test_the_graphs_of_a_stream_share_one_pool_and_buffers(fake_cuda):
    """Two layers' graphs (other weights, the same shapes) on one stream: one memory pool, and one buffer for each
    input position and for the output, which both read and write; calls of the two interleaved each get their own
    result. A graph on another stream, or of another size, has a pool of its own; evicted, its pool goes with it."""
    args, cfg = _case(0)
    other = (args[0], args[1], args[2], args[3].clone() * 2) + args[4:]
    for a in (args, other):
        _serve(a, cfg), _serve(a, cfg)
    first, second = op_graphs._GRAPHS.values()
    assert first.graph.pool is second.graph.pool and len(op_graphs._POOLS) == 1
    assert all(x is y for x, y in zip(first.inputs, second.inputs)) and first.out is second.out
    assert len(op_graphs._BUFFERS) == len(first.inputs) + 1
    for seed in (1, 2, 3):  # interleaved: each replay reads its own inputs and weights
        for a in (args, other):
            a = _case(seed)[0][:3] + a[3:]
            assert torch.equal(_serve(a, cfg)[0], _stand_in_kernels(*a)[0])
    before = _held()
    assert op_graphs._BYTES[0] == before
    fake_cuda["stream"] = 7
    _serve(args, cfg), _serve(args, cfg)
    assert len(op_graphs._POOLS) == 2 and op_graphs._BYTES[0] == _held() == 2 * before
    op_graphs._release(op_graphs._GRAPHS.popitem()[1])  # the stream's only graph: its pool and buffers go with it
    assert len(op_graphs._POOLS) == 1 and op_graphs._BYTES[0] == _held() == before
    fake_cuda["stream"] = 0  # another size on the first stream: a pool of its own, which goes with its graph
    small, _ = _case(0, T=2)
    _serve(small, cfg), _serve(small, cfg)
    assert len(op_graphs._POOLS) == 2
    op_graphs._release(op_graphs._GRAPHS.popitem()[1])
    assert len(op_graphs._POOLS) == 1 and op_graphs._BYTES[0] == _held() == before


def test_inference_mode_and_no_grad_calls_fill_buffers_of_their_own(fake_cuda):
    """inference_mode's buffers are inference tensors, which a no_grad call may not write: a no_grad call after an
    inference_mode call of the same shapes, or sharing only the ids' and weights' layouts, gets a graph of its own
    with buffers of its own, and the right result."""
    args, cfg = _case(0, H=8)
    with torch.inference_mode():
        _serve(args, cfg), _serve(args, cfg)
    wide = (_case(0, H=16)[0][0],) + args[1:3] + (torch.ones(4, 8, 16), torch.ones(4, 16, 4)) + args[5:]
    with torch.no_grad():
        for a in (args, wide):
            assert _serve(a, cfg) is None
            assert torch.equal(_serve(a, cfg)[0], _stand_in_kernels(*a)[0])
    with torch.inference_mode():
        assert torch.equal(_serve(args, cfg)[0], _stand_in_kernels(*args)[0])
    assert op_graphs.counts["failed"] == 0 and op_graphs.counts["captured"] == 3


def test_clear_waits_for_a_capture_in_progress(fake_cuda, monkeypatch):
    """clear() takes the lock a capture holds: from another thread it runs before or after a capture, never inside
    it (stood in for here: the lock is held while the capture runs, so clear() from inside it would wait)."""
    from uniep_dynamo.kernels import megakernel

    inner = megakernel.experts_forward
    held = []
    monkeypatch.setattr(megakernel, "experts_forward", lambda *a, **k: (held.append(op_graphs._LOCK.locked()),
                                                                        inner(*a, **k))[1])
    args, cfg = _case(0)
    _serve(args, cfg), _serve(args, cfg)
    assert held == [True]  # the capture ran under the lock
    op_graphs.clear()
    assert not op_graphs._LOCK.locked() and not op_graphs._GRAPHS and op_graphs._BYTES[0] == 0


def test_the_bytes_bound_holds_once_older_graphs_are_evicted(fake_cuda, monkeypatch):
    """A graph of large scratch, then one of larger buffers but small scratch: evicting the first takes its pool
    with it, so the bound holds with the second alone."""
    scratch = {8: 10_000, 64: 100}  # by hidden size
    real = op_graphs._sizes
    monkeypatch.setattr(op_graphs, "_sizes", lambda slots, hidden, *a, **k: (scratch[hidden.shape[1]],
                                                                            real(slots, hidden, *a, **k)[1]))
    x, cfg = _case(0, H=8)
    monkeypatch.setattr(op_graphs, "MAX_BYTES", 10_000 + sum(t.numel() * t.element_size() for t in x[:3]) + 6 * 8 * 4)
    _serve(x, cfg), _serve(x, cfg)
    y = (_case(0, H=64)[0][0],) + x[1:3] + (torch.ones(4, 8, 64), torch.ones(4, 64, 4)) + x[5:]
    _serve(y, cfg), _serve(y, cfg)
    assert op_graphs.counts["captured"] == 2 and len(op_graphs._GRAPHS) == 1
    assert op_graphs._BYTES[0] == _held() <= op_graphs.MAX_BYTES


def test_a_failed_capture_retires_its_pool(fake_cuda):
    """A capture that fails may leave its allocations in its pool: the graphs already in it keep it, and the next
    graph of that size is captured into a new one."""
    args, cfg = _case(0)
    _serve(args, cfg), _serve(args, cfg)
    (first,) = op_graphs._GRAPHS.values()
    other = args[:3] + (args[3].clone(),) + args[4:]
    fake_cuda["fail"] = True
    _serve(other, cfg), _serve(other, cfg)
    fake_cuda["fail"] = False
    assert op_graphs.counts["failed"] == 1 and first.pool.key not in op_graphs._POOLS
    third = args[:3] + (args[3].clone(),) + args[4:]
    _serve(third, cfg), _serve(third, cfg)
    latest = op_graphs._GRAPHS[next(reversed(op_graphs._GRAPHS))]
    assert latest.pool is not first.pool and op_graphs._POOLS[latest.pool.key] is latest.pool
    assert torch.equal(_serve(args, cfg)[0], _stand_in_kernels(*args)[0])
    assert op_graphs._BYTES[0] == sum(b.numel() * b.element_size() for b, _ in op_graphs._BUFFERS.values()) + \
        first.pool.nbytes + latest.pool.nbytes


def test_non_contiguous_activations_take_no_graph(fake_cuda):
    args, cfg = _case(0)
    hidden = torch.randn(8, 6).t()  # [6, 8], not contiguous
    args = (hidden,) + args[1:]
    assert _serve(args, cfg) is None and _serve(args, cfg) is None
    assert op_graphs.counts["captured"] == 0


def test_a_graph_that_turns_grad_on_inside_is_not_marked():
    """Called under no_grad, a compiled function that enables grad inside (guidance or attribution inside a generation
    loop) takes gradients: Dynamo puts the grad-mode switch in the graph, and its experts ops keep their saved
    buffers. The gradients are eager's."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    weight = model.model.layers[0].mlp.experts.gate_up_proj
    with torch.no_grad():
        expected = torch.autograd.grad(_grad_loss(model, ids), weight)[0]
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda i: _grad_loss(model, i), backend="uniep", options={"inner_backend": keep})
    with torch.no_grad():
        loss = compiled(ids)
        got = torch.autograd.grad(loss, weight)[0]
    specs = _experts_specs(graphs)
    assert specs and not any(s.inference for s in specs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def _grad_loss(fn, ids):
    with torch.enable_grad():
        return fn(ids).logits.float().square().mean()


def test_graphs_under_inductors_cuda_graphs_are_not_marked(monkeypatch):
    """Under inductor's CUDA-graph trees (mode="reduce-overhead" or "max-autotune", or the triton.cudagraphs patch)
    the experts ops make no graphs of their own: a tree's warm-up would hold their buffers in its pool."""
    from uniep_dynamo import backend

    opts = backend.UniepOptions()
    assert backend._under_cuda_graphs(opts, "reduce-overhead") and backend._under_cuda_graphs(opts, "max-autotune")
    assert not backend._under_cuda_graphs(opts, None) and not backend._under_cuda_graphs(opts, "default")
    patched = backend.UniepOptions.from_options({"inductor": {"triton.cudagraphs": True}})
    assert backend._under_cuda_graphs(patched, None)
    marked = []
    monkeypatch.setattr(backend, "mark_inference", lambda gm, nodes=None: marked.append(gm) or 0)
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.compile(model, backend="uniep", options={"inductor": {"triton.cudagraphs": True}})(ids)
        assert not marked
        torch._dynamo.reset()
        torch.compile(model, backend="uniep")(ids)
    assert marked


def test_a_marked_op_refuses_to_be_recorded_for_a_backward():
    """The backstop: an experts op whose spec says inference, called where autograd records it, raises instead of
    saving outputs that may hold no values."""
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(4, 8, generator=g, requires_grad=True)
    ids, weights = torch.randint(0, 2, (4, 2), generator=g), torch.rand(4, 2, generator=g)
    w_up, w_down = torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    marked = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), torch.float32, inference=True).encode()
    with pytest.raises(RuntimeError, match="compiled for a graph that takes no gradient"):
        torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked)
    with torch.no_grad():
        torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], marked)


def test_calls_whose_kernels_hide_the_host_time_take_no_graph():
    """A graph is for calls whose host time is not hidden under their kernels': up to MAX_SLOTS routed slots and
    MAX_GRAPH_FLOP of GEMMs. Qwen3-30B-A3B's prefill of 1024 tokens takes one; Mixtral-8x7B's of 512 tokens (361
    GFLOP) does not, its decode steps do; nothing past MAX_SLOTS, and no empty call."""
    assert op_graphs.worth_a_graph(1024 * 8, 2048, 768)
    assert not op_graphs.worth_a_graph(512 * 2, 4096, 14336) and op_graphs.worth_a_graph(32 * 2, 4096, 14336)
    assert not op_graphs.worth_a_graph(op_graphs.MAX_SLOTS + 1, 8, 8) and not op_graphs.worth_a_graph(0, 8, 8)


def test_the_memory_estimate_counts_the_pools_segments():
    assert op_graphs._pool_bytes([1000, 1 << 20]) == 2 << 20  # small buffers: the pool's one 2 MiB segment
    assert op_graphs._pool_bytes([3 << 20]) == (2 << 20) + (20 << 20)
    assert op_graphs._pool_bytes([(30 << 20) + 1]) == (2 << 20) + (32 << 20)


# -- uniep.moe_block: router and experts in one graph (op_graphs.block_forward) ------------------------------------------

def _block_case(seed, T=6, H=8, E=4, K=2, shared=True, router_weight=None):
    """The block's arguments (before the config and eager) and the output the stand-ins give for them. Not
    ``shared``: the router reads other hidden states than the experts (other values, so that a graph that mixed
    them up would be seen)."""
    from uniep_dynamo.spec import RouterSpec

    (hidden, _, _, w_up, w_down, b_up, b_down, spec), cfg = _case(seed, T, H, E, K)
    _WEIGHTS.setdefault("router", torch.randn(E, H, generator=torch.Generator().manual_seed(99)))
    router_weight = router_weight if router_weight is not None else _WEIGHTS["router"]
    router_hidden = hidden if shared else hidden.flip(0) * 2
    rspec = RouterSpec("softmax_topk", E, K)
    _, weights, ids = _stand_in_router(router_hidden, router_weight, None, None, rspec)
    expected = _stand_in_kernels(hidden, ids, weights, w_up, w_down, b_up, b_down, spec)[0]
    return (router_hidden, router_weight, None, None, rspec, hidden, w_up, w_down, b_up, b_down, spec), cfg, expected


def _block(args, cfg, eager_calls=None):
    def eager(config):
        assert config is cfg
        if eager_calls is not None:
            eager_calls.append(1)
        rh, rw, rb, sb, rspec, hidden, w_up, w_down, b_up, b_down, spec = args
        _, weights, ids = _stand_in_router(rh, rw, rb, sb, rspec)
        return _stand_in_kernels(hidden, ids, weights, w_up, w_down, b_up, b_down, spec)[0]

    return op_graphs._block_from_graph(*args, cfg, eager)


@pytest.mark.parametrize("shared", [True, False], ids=["one_hidden", "two_hiddens"])
def test_a_block_runs_once_then_is_captured_then_replays_router_and_experts(fake_cuda, shared):
    """The block's first call of a kind runs eager; the second captures router and experts into one graph; every
    later call replays it on its own inputs: the router's hidden states copied in (once where the experts read the
    same memory), the routing computed again inside the graph, and the output the two ops' on those inputs."""
    eager_calls = []
    for seed in range(4):
        args, cfg, expected = _block_case(seed, shared=shared)
        assert torch.equal(_block(args, cfg, eager_calls=eager_calls), expected)
    assert len(eager_calls) == 1 and op_graphs.counts["captured"] == 1 and op_graphs.counts["replayed"] == 3
    (entry,) = op_graphs._GRAPHS.values()
    assert len(entry.inputs) == (1 if shared else 2)
    assert [fn.__name__ for fn, *_ in entry.graph.calls] == ["_stand_in_router", "_stand_in_kernels", "_write"]


def test_a_block_whose_kernels_are_not_the_fused_ones_takes_no_graph(fake_cuda):
    """A block whose router or experts call the fused kernels do not take is refused a graph at its capture: its
    later calls run eager too."""
    fake_cuda["unfused"] = True
    eager_calls = []
    for seed in range(3):
        args, cfg, expected = _block_case(seed)
        assert torch.equal(_block(args, cfg, eager_calls=eager_calls), expected)
    assert len(eager_calls) == 3 and op_graphs.counts["captured"] == 0 and not op_graphs._GRAPHS


def test_a_router_weight_at_another_address_is_another_block_graph(fake_cuda):
    args, cfg, _ = _block_case(0)
    moved = args[1].clone()
    for weight in (args[1], moved):
        for seed in range(3):
            a, _, expected = _block_case(seed, router_weight=weight)
            assert torch.equal(_block(a, cfg), expected)
    assert op_graphs.counts["captured"] == 2


def test_the_block_op_gives_the_two_ops_bits_and_refuses_a_backward():
    """uniep::moe_block called directly (CPU: the reference paths) returns the experts op's output on the router op's
    routing, bit for bit, for one hidden tensor or two; recorded for a backward, it raises."""
    from uniep_dynamo.kernels.gate_program import SILU_GLU_EXPR, encode
    from uniep_dynamo.spec import ExpertsSpec, RouterSpec

    g = torch.Generator().manual_seed(8)
    T, H, I, E, K = 5, 16, 8, 4, 2
    hidden = torch.randn(T, H, generator=g)
    router_w = torch.randn(E, H, generator=g)
    w_up, w_down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    rspec = RouterSpec("softmax_topk", E, K, renorm=True).encode()
    spec = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), torch.float32, inference=True).encode()
    plain = ExpertsSpec("oi", "oi", encode("chunk", SILU_GLU_EXPR), torch.float32).encode()
    planned = RouterSpec("softmax_topk", E, K, renorm=True, plan=True).encode()
    for router_hidden, router in ((hidden, rspec), (hidden * 0.5, rspec), (hidden, planned)):
        with torch.no_grad():
            _, weights, ids, *plan = torch.ops.uniep.moe_router(router_hidden, router_w, None, None, router)
            given = dict(zip(("plan_row_order", "plan_slot_row", "plan_offsets"), plan)) if router == planned else {}
            expected = torch.ops.uniep.moe_experts(hidden, ids, weights, w_up, w_down, None, None, [], plain,
                                                   **given)[0]
            got = torch.ops.uniep.moe_block(router_hidden, router_w, None, None, router, hidden, w_up, w_down, None,
                                            None, spec)
        assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="has none of"):
        torch.ops.uniep.moe_block(hidden, router_w.requires_grad_(), None, None, rspec, hidden, w_up, w_down, None,
                                  None, spec)


_WRITES = {"method": lambda hs: hs.mul_(3.0), "aliased_name": lambda hs: hs.sigmoid_(),
           "inplace_keyword": lambda hs: torch.nn.functional.silu(hs, inplace=True),
           "foreach": lambda hs: torch._foreach_mul_([hs], 3.0), "operator": lambda hs: hs.__imul__(3.0)}


@pytest.mark.parametrize("write", sorted(_WRITES))
def test_a_write_between_router_and_experts_keeps_the_two_ops(write):
    """The block runs the router where the experts op ran: where the graph writes in place between the two (here
    the hidden states, changed after routing, in each way a graph spells a write), fusing would route on the changed
    states, so the two ops stay, and the output is eager's."""
    import types

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        hs = hidden_states.view(-1, d)
        _, weights, ids = self.gate(hs)
        _WRITES[write](hs)
        return self.experts(hs, ids, weights).reshape(b, s, d)

    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(11))
    compiled, graphs = _compiled(model)
    with torch.no_grad():
        expected = model(ids).logits
        logits = compiled(ids).logits
    assert not _blocks(graphs) and len(_op_nodes(graphs, torch.ops.uniep.moe_router.default)) == 2
    assert all(s.inference for s in _experts_specs(graphs))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_the_reports_after_view_is_the_graph_that_runs():
    """Under no_grad the report's "after" view holds the blocks (not the router and experts ops they replaced), and
    every node a rewrite names as added is in it."""
    from uniep_dynamo.report import recording

    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    with recording() as recorder, torch.no_grad():
        torch.compile(model, backend="uniep", options={"inner_backend": "aot_eager"})(
            torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(12)))
    graph = recorder.to_dict()["graphs"][0]
    after = {row["id"]: row["target"] for row in graph["after"]}
    targets = list(after.values())
    assert sum("moe_block" in t for t in targets) == 2
    assert not any("moe_router" in t or "moe_experts" in t for t in targets)
    assert all(name in after for r in graph["rewrites"] for name in r["added"])


def test_a_no_grad_function_compiled_and_called_with_grad_on_is_marked():
    """A function decorated with torch.no_grad(), compiled and called with grad mode on: its graph switches grad mode
    off and back (_set_grad_enabled nodes); what runs with it off is marked and fused, and the output is eager's."""
    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(13))

    @torch.no_grad()
    def logits(i):
        return model(i).logits

    expected = logits(ids)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(logits, backend="uniep", options={"inner_backend": keep})(ids)
    assert any(n.target is torch._C._set_grad_enabled for gm in graphs for n in gm.graph.nodes)
    assert len(_blocks(graphs)) == 2
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_only_the_no_grad_region_of_a_graph_that_takes_gradients_is_marked():
    """A graph that takes a gradient through one layer and runs another under torch.no_grad(): the ops of the no_grad
    region become a block, those of the other layer stay ops that save their buffers, and the gradients are eager's
    (aot_eager builds the backward). The report says the region's rewrites take no backward op, and finds no gap."""
    from uniep_dynamo.report import recording

    torch._dynamo.reset()
    model = build_model("qwen3_moe")
    first, second = model.model.layers[0].mlp, model.model.layers[1].mlp
    x = torch.randn(2, 5, first.gate.weight.shape[1], generator=torch.Generator().manual_seed(14))

    def f(x):
        with torch.no_grad():
            y = second(x)
        return first(x + y)

    expected = f(x)
    expected_grad = torch.autograd.grad(expected.square().sum(), first.experts.gate_up_proj)[0]
    with recording() as recorder:
        got = torch.compile(f, backend="uniep", options={"inner_backend": "aot_eager"})(x)
        got_grad = torch.autograd.grad(got.square().sum(), first.experts.gate_up_proj)[0]
    (record,) = recorder.graphs
    assert record.aot_graphs["forward"] == {"moe_block": 1, "moe_router": 1, "moe_experts": 1}
    assert record.aot_graphs["backward"]["moe_experts_backward"] == 1
    assert sorted((r.op, r.needs_grad) for r in record.rewrites) == [
        ("moe_experts", False), ("moe_experts", True), ("moe_router", False), ("moe_router", True)]
    assert record.coverage_gaps() == []
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-5)


def test_a_forgotten_refusal_is_no_capture_of_unfused_kernels(fake_cuda, monkeypatch):
    """A kind of call whose kernels are not the fused ones is refused at its capture (its second call), by the fused
    kernels' checks; the kinds remembered as seen and as refused are forgotten separately (each past MAX_SEEN), and a
    kind seen but no longer refused is asked again, never captured."""
    monkeypatch.setattr(op_graphs, "MAX_SEEN", 3)

    def call(T, fused):
        fake_cuda["unfused"] = not fused
        args, cfg, expected = _block_case(0, T=T)
        assert torch.equal(_block(args, cfg), expected)

    # unfused kinds 1, 2, 4, 5 and a fused 3, each once, past MAX_SEEN; then 4 again (refused at its capture) and again
    for T, fused in ((1, False), (2, False), (3, True), (4, False), (5, False), (4, False), (4, False)):
        call(T, fused)
    assert op_graphs.counts["captured"] == 0 and not op_graphs._GRAPHS


def test_cublas_math_flags_are_in_a_blocks_key(fake_cuda):
    """The block's graph holds the router's logits GEMM, whose math follows cuBLAS's process-wide flags: a call after
    a flag changed is another graph, not a replay of the GEMM captured under the old flag."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        for flag in (False, True):
            matmul.allow_tf32 = flag
            for seed in range(3):
                args, cfg, expected = _block_case(seed)
                assert torch.equal(_block(args, cfg), expected)
    finally:
        matmul.allow_tf32 = before
    assert op_graphs.counts["captured"] == 2
