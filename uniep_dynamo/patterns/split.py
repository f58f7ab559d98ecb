"""Whether a module's region crosses the boundary of a graph piece that Dynamo's DDPOptimizer split off.

DDPOptimizer (torch/_dynamo/backends/distributed.py) cuts a Dynamo graph at DDP's gradient-bucket boundaries,
``split_module``s it and compiles each piece through the backend, after setting the piece's
``compile_subgraph_reason`` to "DDPOptimizer intentional graph-break". A value one piece computes reaches the
next as a placeholder that carries a copy of its producer's meta (example_value, nn_module_stack) but not
Dynamo's "grapharg", which only the graph's real inputs have; a value the next piece needs leaves this one
through the output node. uniep_dynamo/ddp.py rewrites the whole graph before the split; where that did not
run, a region cut in two must be declined for that reason, not for the first check a missing value fails.
"""
from __future__ import annotations

from torch.fx import Graph, Node

from . import graph_utils as gu


def is_ddp_piece(graph: Graph) -> bool:
    reason = getattr(graph.owning_module, "compile_subgraph_reason", None)
    return "DDPOptimizer" in str(getattr(reason, "reason", reason) or "")


def _is_split_input(node: Node) -> bool:
    return node.op == "placeholder" and "example_value" in node.meta and "grapharg" not in node.meta


def ddp_cut_reason(anchor: Node, other_failure: bool) -> str | None:
    """Why the region of `anchor`'s module is cut: it reads a value of its module that an earlier piece
    computed, or (where no check failed in the module, `other_failure` False) it hands one to a later piece.
    None outside DDPOptimizer's pieces. (A placeholder carries its producer's nn_module_stack, so a value of
    the module computed in an earlier piece has the module's path; the hidden states and the router's
    outputs belong to other modules.)"""
    if not is_ddp_piece(anchor.graph):
        return None
    module = gu.module_path(anchor)
    seen, stack, leaves = set(), [anchor], []
    while stack:  # the anchor's module-local ancestors and descendants
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_split_input(node):
            return (f"the region is split across DDP buckets: {node.name}, an input of {anchor.name}, is computed "
                    "in an earlier piece of the graph, which Dynamo's DDPOptimizer cut at a gradient bucket "
                    "boundary (uniep rewrites before that split unless wrapping DDPOptimizer failed; see the uniep "
                    "log, or set torch._dynamo.config.optimize_ddp = False)")
        if any(user.op == "output" for user in node.users):
            leaves.append(node)
        near = [n for n in node.all_input_nodes + list(node.users) if n.op != "output"]
        stack.extend(n for n in near if gu.module_path(n) == module)
    if leaves and not other_failure:
        return (f"the region is split across DDP buckets: {leaves[0].name}, computed from {anchor.name}, is handed "
                "to a later piece of the graph, which Dynamo's DDPOptimizer cut at a gradient bucket boundary "
                "(uniep rewrites before that split unless wrapping DDPOptimizer failed; see the uniep log, or set "
                "torch._dynamo.config.optimize_ddp = False)")
    return None
