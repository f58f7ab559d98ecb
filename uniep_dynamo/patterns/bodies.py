"""The bodies of higher-order ops that run as part of a Dynamo graph, where MoE regions also live.

Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not, with or without a selective
policy; HF's ``gradient_checkpointing_enable``) Dynamo puts the checkpointed block into a body graph
(``wrap_body_<n>``) that the outer graph calls through ``tag_activation_checkpoint``; ``wrap`` and
``invoke_subgraph`` (``torch.compiler.nested_compile_region``) hold their code the same way. AOTAutograd
traces through these bodies, so an op put into a body lands in the forward graph, and under checkpointing
the partitioner recomputes it in the backward instead of saving what it saves.

A body's inputs are placeholders: expert weights passed into a body are tensors like any other (the op takes
weight tensors, parameters or not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

# GraphModule meta key of a body: the outer graph's higher-order op calls that run it
OUTER_CALLS = "uniep_outer_calls"

# higher-order op -> what the report calls its body
BODY_HOPS = {
    "tag_activation_checkpoint": "activation checkpoint",
    "wrap": "wrap",
    "invoke_subgraph": "nested compile region",
}


@dataclass
class Body:
    name: str  # the attribute of the outer graph module that holds it (wrap_body_0)
    module: GraphModule
    kind: str  # what the report calls it ("activation checkpoint")


def forward_bodies(gm: GraphModule) -> list[Body]:
    """The bodies of `gm`'s higher-order op calls that run inline in its forward, each once, with their calls
    recorded (``OUTER_CALLS``)."""
    found: dict[int, tuple[Body, list]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        kind = BODY_HOPS.get(node.target.name())
        ref = node.args[0] if node.args else None
        if kind is None or not (isinstance(ref, Node) and ref.op == "get_attr"):
            continue
        module = getattr(gm, ref.target, None)
        if not isinstance(module, GraphModule):
            continue
        body, calls = found.setdefault(id(module), (Body(ref.target, module, kind), []))
        calls.append(node)
    bodies = []
    for body, calls in found.values():
        body.module.meta[OUTER_CALLS] = calls
        bodies.append(body)
    return bodies


def walk(gm: GraphModule, where: str = "", kind: str = ""):
    """`gm` and every forward body under it, outer graphs first: (graph module, where, kind), where ``where`` is
    "" for `gm` itself and the bodies' names joined by '/' below it (``wrap_body_0``)."""
    yield gm, where, kind
    for body in forward_bodies(gm):
        yield from walk(body.module, f"{where}/{body.name}" if where else body.name, body.kind)
