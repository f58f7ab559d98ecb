"""The bodies of higher-order ops that run as part of a Dynamo graph, where MoE regions also live.

Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not, with or without a selective
policy; HF's ``gradient_checkpointing_enable``) Dynamo puts the checkpointed block into a body graph
(``wrap_body_<n>``) that the outer graph calls through ``tag_activation_checkpoint``; ``wrap`` and
``invoke_subgraph`` (``torch.compiler.nested_compile_region``) hold their code the same way. AOTAutograd
traces through these bodies, so an op put into a body lands in the forward graph, and under checkpointing
the partitioner recomputes it in the backward instead of saving what it saves.

A body's inputs are placeholders. ``forward_bodies`` records on each the outer arguments its calls pass in
(``graph_utils.OUTER_ARGS``), so that ``parameter_of`` can prove an expert weight inside the body is a
module parameter: where one body serves several calls (``invoke_subgraph``), it must be one in every call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import OUTER_ARGS

# GraphModule meta key of a body: the outer graph's higher-order op calls that run it
OUTER_CALLS = "uniep_outer_calls"

# higher-order op -> (index of its first operand in the call's args, what the report calls its body)
BODY_HOPS = {
    "tag_activation_checkpoint": (1, "activation checkpoint"),
    "wrap": (1, "wrap"),
    "invoke_subgraph": (2, "nested compile region"),
}


@dataclass
class Body:
    name: str  # the attribute of the outer graph module that holds it (wrap_body_0)
    module: GraphModule
    kind: str  # what the report calls it ("activation checkpoint")


def forward_bodies(gm: GraphModule) -> list[Body]:
    """The bodies of `gm`'s higher-order op calls that run inline in its forward, each once, with their calls
    recorded (``OUTER_CALLS``) and their placeholders annotated with the calls' outer arguments."""
    found: dict[int, tuple[Body, list]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        entry = BODY_HOPS.get(node.target.name())
        ref = node.args[0] if node.args else None
        if entry is None or not (isinstance(ref, Node) and ref.op == "get_attr"):
            continue
        module = getattr(gm, ref.target, None)
        if not isinstance(module, GraphModule):
            continue
        first, kind = entry
        body, calls = found.setdefault(id(module), (Body(ref.target, module, kind), []))
        calls.append(node)
    bodies = []
    for body, calls in found.values():
        body.module.meta[OUTER_CALLS] = calls
        first = BODY_HOPS[calls[0].target.name()][0]
        placeholders = [n for n in body.module.graph.nodes if n.op == "placeholder"]
        if all(len(call.args) - first == len(placeholders) for call in calls):
            for i, placeholder in enumerate(placeholders):
                placeholder.meta[OUTER_ARGS] = [call.args[first + i] for call in calls]
        # else: inputs left unannotated, so no weight in the body proves to be a parameter (the near miss says so)
        bodies.append(body)
    return bodies


def walk(gm: GraphModule, where: str = "", kind: str = ""):
    """`gm` and every forward body under it, outer graphs first: (graph module, where, kind), where ``where`` is
    "" for `gm` itself and the bodies' names joined by '/' below it (``wrap_body_0``)."""
    yield gm, where, kind
    for body in forward_bodies(gm):
        yield from walk(body.module, f"{where}/{body.name}" if where else body.name, body.kind)
