"""Replace a proven experts region by one call of torch.ops.uniep.moe_experts."""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import GraphModule

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


def lower_experts(gm: GraphModule, match: ExpertsMatch, reuse_saved: bool = True) -> torch.fx.Node:
    graph = gm.graph
    spec_text = dataclasses.replace(match.spec, reuse_saved=reuse_saved).encode()
    root = match.root
    with graph.inserting_before(root):
        call = graph.call_function(
            torch.ops.uniep.moe_experts.default,
            (match.hidden, match.topk_ids, match.topk_weights, match.w_up, match.w_down, match.b_up, match.b_down,
             list(match.post_operands), spec_text))
        out = graph.call_function(operator.getitem, (call, 0))
    take_place(root, out, call)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return call
