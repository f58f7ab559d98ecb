"""Replace a proven experts region by one call of torch.ops.uniep.moe_experts."""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import GraphModule

from ..patterns import graph_utils as gu
from ..patterns.values import ExpertsMatch


def take_place(old: torch.fx.Node, new: torch.fx.Node, call: torch.fx.Node) -> None:
    """`new` (an output of the op `call`) replaces `old`: its users, source location and example value."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            call.meta.setdefault(key, old.meta[key])
            new.meta[key] = old.meta[key]
    if "example_value" in old.meta:
        new.meta["example_value"] = old.meta["example_value"]
    old.replace_all_uses_with(new)


def _fake_cast(fake: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return fake.to(dtype)
    with mode:
        return fake.to(dtype)


def cast_to(graph: torch.fx.Graph, node, dtype):
    """`node.to(dtype)` inserted at the graph's insertion point, as autocast casts an op's inputs in eager; `node`
    itself where there is nothing to cast."""
    if node is None or dtype is None:
        return node
    fake = gu.tensor_meta(node)
    if fake is None or fake.dtype == dtype or not fake.dtype.is_floating_point:
        return node
    cast = graph.call_method("to", (node, dtype))
    cast.meta["example_value"] = _fake_cast(fake, dtype)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in node.meta:
            cast.meta[key] = node.meta[key]
    return cast


def lower_experts(gm: GraphModule, match: ExpertsMatch, reuse_saved: bool = True) -> torch.fx.Node:
    graph = gm.graph
    # numbered within the graph (ExpertsSpec.site): two calls on the same inputs stay two ops, each with its buffers
    site = 1 + sum(n.target is torch.ops.uniep.moe_experts.default for n in graph.nodes)
    spec_text = dataclasses.replace(match.spec, reuse_saved=reuse_saved, site=site if reuse_saved else 0).encode()
    root = match.root
    with graph.inserting_before(root):
        hidden, w_up, w_down, b_up, b_down = (cast_to(graph, node, match.compute_dtype) for node in
                                              (match.hidden, match.w_up, match.w_down, match.b_up, match.b_down))
        call = graph.call_function(
            torch.ops.uniep.moe_experts.default,
            (hidden, match.topk_ids, match.topk_weights, w_up, w_down, b_up, b_down,
             list(match.post_operands), spec_text))
        out = graph.call_function(operator.getitem, (call, 0))
        if match.out_cast is not None:
            # eager rounds the K-sum to its dtype, then casts it (under CPU autocast: bf16 sum, then .to(fp32))
            fake = gu.tensor_meta(root)
            if fake is not None:
                out.meta["example_value"] = _fake_cast(fake, match.spec.out_dtype)
            out = graph.call_method("to", (out, match.out_cast))
    take_place(root, out, call)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return call
