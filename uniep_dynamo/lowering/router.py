"""Replace a proven router region by one call of torch.ops.uniep.moe_router."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from ..patterns.router import RouterMatch
from .experts import cast_to, take_place


def lower_router(gm: GraphModule, match: RouterMatch) -> torch.fx.Node:
    graph = gm.graph
    # At the region's last node every input is defined (the region reads them all); the matcher made
    # sure no outside reader of the outputs comes earlier.
    last = match.nodes[-1]
    with graph.inserting_before(last):
        # under autocast, the linear's operands cast as eager's autocast casts them
        hidden, weight, bias = (cast_to(graph, n, match.compute_dtype) for n in (match.hidden, match.weight, match.bias))
        call = graph.call_function(torch.ops.uniep.moe_router.default,
                                   (hidden, weight, bias, match.score_bias, match.spec.encode()))
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
    for new, old in zip(outs, (match.logits, match.weights, match.ids)):
        take_place(old, new, call)
    for node in reversed(match.kept):  # logits.float() read outside: after the op, reading its logits
        outs[-1].append(node)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return call


def share_routing_plan(gm: GraphModule, router_call: torch.fx.Node, experts_calls: list) -> torch.fx.Node | None:
    """When the router's ids feed exactly one experts op over the same experts, the router op also
    computes the routing plan (its select kernel counts the experts of each block in the pass that picks
    them) and the experts op takes it instead of sorting the ids again. Returns that experts call."""
    import dataclasses

    from ..patterns import graph_utils as gu
    from ..spec import decode_router_spec

    ids_out = next((u for u in router_call.users if u.target is operator.getitem and u.args[1] == 2), None)
    readers = [c for c in experts_calls if ids_out is not None and c.args[1] is ids_out]
    if len(readers) != 1 or readers[0].kwargs.get("plan_row_order") is not None:
        return None
    experts = readers[0]
    spec = decode_router_spec(router_call.args[4])
    w_up = gu.tensor_meta(experts.args[3])
    if w_up is None or w_up.shape[0] != spec.num_experts:
        return None
    router_call.args = router_call.args[:4] + (dataclasses.replace(spec, plan=True).encode(),)
    graph = gm.graph
    with graph.inserting_after(ids_out):
        plan = [graph.call_function(operator.getitem, (router_call, i)) for i in (5, 4, 3)][::-1]
    experts.kwargs = {**experts.kwargs, "plan_row_order": plan[0], "plan_slot_row": plan[1], "plan_offsets": plan[2]}
    return experts
