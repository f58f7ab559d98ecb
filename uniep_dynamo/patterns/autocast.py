"""Autocast in a Dynamo graph: which autocast is active at each node, and which dtype an op has without it.

Dynamo records autocast two ways. Entered outside the compiled function, it is global state at compile
time (Dynamo guards on it, so the graph only ever runs under it): nothing in the graph shows it. Entered
inside, the graph holds ``torch.amp.autocast_mode._enter_autocast(device, dtype, enabled, cache)`` and
``_exit_autocast(enter)`` around the code it covers (torch 2.13); a higher-order op's body (a checkpoint's
``wrap_body_0``) carries none of its own when the context is entered around the call in the outer graph.

Either way the example values of the nodes hold the dtypes eager computes under autocast, since Dynamo
propagates fake tensors through the autocast dispatch key: ``linear``, ``bmm`` and ``matmul`` read fp32
inputs and return the autocast dtype on CPU and CUDA alike; on CUDA ``softmax``, ``sum``, ``cumsum``
without a ``dtype`` argument return fp32 for half inputs, and ``exp``, ``pow``, ``log``, ... run in fp32.
The matchers take that record as the proof of eager's dtype flow, and this module as the reason to look.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from . import graph_utils as gu
from .bodies import OUTER_CALLS

# device types whose autocast state the backend reads at compile time
DEVICE_TYPES = ("cpu", "cuda")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(dtype: torch.dtype | None) -> str:
    return f"autocast({_dtype_name(dtype)})" if dtype is not None else "no autocast"


def _is_enter(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "_enter_autocast"


def _is_exit(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "_exit_autocast"


def global_state() -> dict:
    """{device type: autocast dtype, or None where autocast is off} as the compiling thread has it."""
    return {d: (torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in DEVICE_TYPES}


def _outer_call(graph: Graph):
    """The outer graph's higher-order op calls that run `graph` as their body (patterns/bodies.py records them),
    or None for a graph that is no body."""
    owner = graph.owning_module
    return (owner.meta.get(OUTER_CALLS) if owner is not None else None) or None


def state_at_start(graph: Graph) -> dict | None:
    """The autocast state a graph starts under: for a body, the state at the outer call (all calls alike);
    else the global state. None where the calls disagree."""
    calls = _outer_call(graph)
    if not calls:
        return global_state()
    states = [states_by_node(call.graph)[call] for call in calls]
    return states[0] if all(s == states[0] for s in states) else None


def states_by_node(graph: Graph) -> dict:
    """{node: {device type: autocast dtype or None}} for every node of `graph`, from the state it starts
    under and its _enter_autocast / _exit_autocast nodes. A node maps to None where the start is unknown."""
    start = state_at_start(graph)
    current = start
    before_enter: dict = {}
    states: dict = {}
    for node in graph.nodes:
        states[node] = current
        if current is None:
            continue
        if _is_enter(node):
            device, dtype, enabled = (list(node.args) + [None, None, True])[:3]
            device = node.kwargs.get("device_type", device)
            enabled = node.kwargs.get("enabled", enabled)
            dtype = node.kwargs.get("dtype", dtype)
            before_enter[node] = current
            current = dict(current)
            if enabled:
                current[device] = dtype if dtype is not None else torch.get_autocast_dtype(device)
            else:
                current[device] = None
        elif _is_exit(node) and node.args and node.args[0] in before_enter:
            current = before_enter[node.args[0]]
    return states


class AutocastView:
    """The autocast state at the nodes of one graph, computed once."""

    def __init__(self, graph: Graph):
        self.states = states_by_node(graph)

    def at(self, node: Node, device_type: str):
        """(known, dtype): whether the state at `node` is known, and the autocast dtype for the device type
        (None where autocast is off)."""
        state = self.states.get(node)
        if state is None:
            return False, None
        return True, state.get(device_type)


def device_type(node: Node) -> str | None:
    t = gu.tensor_meta(node)
    return t.device.type if t is not None else None


_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv}


def _stand_in(arg):
    if isinstance(arg, Node):
        t = gu.tensor_meta(arg)
        if t is None:
            return None
        return torch.empty((1,) * t.dim(), dtype=t.dtype, device="meta")
    return arg if isinstance(arg, (int, float, bool)) else None


def plain_dtype(node: Node, name: str):
    """The dtype `node` would have without autocast, from the dtypes its inputs were recorded with, for the
    floating-point steps autocast can change (reductions, softmax, arithmetic, unary math); None where
    autocast leaves the op alone or the rule does not know it (the caller then skips the node)."""
    args = list(node.args)
    if not args or not isinstance(args[0], Node) or gu.tensor_meta(args[0]) is None:
        return None
    first = gu.tensor_meta(args[0]).dtype
    if not first.is_floating_point:
        return None
    if name in ("softmax", "log_softmax", "sum", "cumsum", "prod", "mean"):
        dtype = node.kwargs.get("dtype")
        if dtype is None:
            dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        return dtype if dtype is not None else first
    if name in _ARITHMETIC:
        stand_ins = [_stand_in(a) for a in args[:2]]
        if len(stand_ins) < 2 or any(s is None for s in stand_ins):
            return None
        return torch.result_type(*stand_ins) if isinstance(stand_ins[0], torch.Tensor) else \
            torch.result_type(stand_ins[1], stand_ins[0])
    if name in ("sigmoid", "silu", "gelu", "relu", "tanh", "exp", "log", "pow", "rsqrt", "reciprocal", "softplus",
                "clamp", "neg", "square", "sqrt", "abs"):
        return first
    return None
