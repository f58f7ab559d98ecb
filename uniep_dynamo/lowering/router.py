"""Replace a proven router region by one call of torch.ops.uniep.moe_router."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from ..patterns.router import RouterMatch


def lower_router(gm: GraphModule, match: RouterMatch) -> torch.fx.Node:
    graph = gm.graph
    # At the region's last node every input is defined (the region reads them all); the matcher made
    # sure no outside reader of the outputs comes earlier.
    last = match.nodes[-1]
    with graph.inserting_before(last):
        call = graph.call_function(torch.ops.uniep.moe_router.default,
                                   (match.hidden, match.weight, match.bias, match.score_bias, match.spec.encode()))
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
    for new, old in zip(outs, (match.logits, match.weights, match.ids)):
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in old.meta:
                new.meta[key] = old.meta[key]
                call.meta.setdefault(key, old.meta[key])
        if "example_value" in old.meta:
            new.meta["example_value"] = old.meta["example_value"]
        old.replace_all_uses_with(new)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return call
