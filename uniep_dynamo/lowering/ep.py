"""Replace a proven expert-parallel dispatch, exchange, combine or whole layer by one call of
torch.ops.uniep.ep_dispatch / ep_exchange / ep_combine / ep_layer (patterns/ep.py says what each replaces)."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from ..patterns.ep import CombineMatch, DispatchMatch, ExchangeMatch, LayerMatch
from .experts import take_place


def lower_dispatch(gm: GraphModule, match: DispatchMatch, gather_counts: bool = False,
                   replaced_by: dict | None = None) -> torch.fx.Node:
    """``gather_counts``: where the exchanges are rewritten too (the rewrite_ep_exchange option), the dispatch
    all-gathers the count table they take their split sizes and layout from (ep.ep_dispatch). ``replaced_by``
    takes each replaced node -> its replacement, for later matches in the graph that read them."""
    graph = gm.graph
    last = match.nodes[-1]
    with graph.inserting_after(last):
        call = graph.call_function(torch.ops.uniep.ep_dispatch.default,
                                   (match.hidden, match.ids, match.num_experts, match.world,
                                    match.group_name, gather_counts))
    outs = {}
    with graph.inserting_after(call):
        for i in reversed(range(4)):
            outs[i] = graph.call_function(operator.getitem, (call, i))
    for i, old in enumerate((match.rows, match.order, match.send_counts, match.recv_counts)):
        if old is match.recv_counts:  # the buffer the exchange was copied into: its readers after the copy
            for user in [u for u in old.users if u is not match.copy]:
                user.replace_input_with(old, outs[i])
            outs[i].meta.update({k: old.meta[k] for k in ("example_value", "stack_trace") if k in old.meta})
        else:
            take_place(old, outs[i], call)
        if replaced_by is not None:
            replaced_by[old] = outs[i]
    _erase_region(match.nodes, graph)
    return call


def lower_combine(gm: GraphModule, match: CombineMatch) -> torch.fx.Node:
    graph = gm.graph
    with graph.inserting_before(match.out):
        call = graph.call_function(torch.ops.uniep.ep_combine.default, (match.rows, match.order, match.weights))
    take_place(match.out, call, call)
    _erase_region(match.nodes, graph)
    return call


def lower_exchange(gm: GraphModule, match: ExchangeMatch, knobs: dict | None = None,
                   sequential: bool = False) -> torch.fx.Node:
    """``sequential``: the exchange runs the replaced steps in one op (the all-to-all, the experts, the all-to-all
    back) rather than its overlapped transfers (the overlap_ep option off)."""
    import json

    graph = gm.graph
    with graph.inserting_after(match.back):
        call = graph.call_function(torch.ops.uniep.ep_exchange.default,
                                   (match.send, match.recv_counts, match.w_up, match.w_down, match.b_up, match.b_down,
                                    match.experts_spec, match.group_name, match.send_sizes, match.recv_sizes,
                                    json.dumps(knobs, sort_keys=True) if knobs else "", sequential))
    with graph.inserting_after(call):
        back = graph.call_function(operator.getitem, (call, 0))
    take_place(match.back, back, call)
    _erase_region(match.nodes, graph)
    return call


def lower_layer(gm: GraphModule, match: LayerMatch, device_plan: int) -> torch.fx.Node:
    """One uniep.ep_layer in place of the dispatch, exchange and combine calls (and the host reads of the counts
    that only sized the exchange): the same steps in one op, whose plan may stay on the device (``device_plan``: its
    argument, device_choice's OFF / ON / AUTO)."""
    graph = gm.graph
    with graph.inserting_before(match.out):
        call = graph.call_function(torch.ops.uniep.ep_layer.default,
                                   (match.hidden, match.ids, match.weights, match.w_up, match.w_down, match.b_up,
                                    match.b_down, match.experts_spec, match.group_name, match.world,
                                    not match.sequential, match.knobs, device_plan))
    with graph.inserting_after(call):
        out = graph.call_function(operator.getitem, (call, 0))
    take_place(match.out, out, call)
    _erase_region(match.nodes, graph)
    return call


def _erase_region(nodes, graph):
    """Erase the replaced region's nodes (last first, each once nothing reads it); any left means a reader
    outside the region still needs one of them, which the match should have refused."""
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)
    alive = set(graph.nodes)
    left = [n.name for n in nodes if n in alive]
    if left:
        raise AssertionError(f"uniep: EP lowering left region nodes {left} with readers")
