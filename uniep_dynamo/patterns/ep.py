"""Expert-parallel patterns: the dispatch plan with its count exchange, and the unpermute-and-combine.

HF transformers' ``AllToAllEP`` (5.23) reaches Dynamo as two graphs, whatever the config: the split
sizes go to the host (``.tolist()``) and the experts call sits behind ``if tokens.shape[0] == 0``, a
branch on a data-dependent size that Dynamo cannot keep in a graph even with
``capture_scalar_outputs``. So no graph holds the whole layer, and uniep rewrites each side in the
graph it lands in:

    dispatch (first graph)   ids.reshape(-1) -> argsort -> hidden[order // K];
                             zeros(E).scatter_add_(ids, 1).view(W, E / W) -> all_to_all of the counts
                             -> torch.ops.uniep.ep_dispatch: the stable routing plan (rows ordered by
                             expert, token, k), the gathered rows, and the count exchange, in one op
    combine (second graph)   empty_like(rows); buf[order] = rows; buf.view(T, K, H) * w[..., None];
                             .sum(1) -> torch.ops.uniep.ep_combine: the fixed-order combine

The token all-to-alls and the experts between them stay where they are (the experts are the experts
pattern's). Each rule below checks the constants it binds; a candidate that fails one is left alone
with a near miss. The sort's order is free to change: argsort does not promise one among equal ids,
the combine reads the same order back, and the stable order is the one a single GPU uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from . import graph_utils as gu
from .experts import _require_no_writes_to_inputs
from .values import Mismatch, NearMiss

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class DispatchMatch:
    """hidden [T, H], ids [T, K] -> the nodes the op's outputs replace."""
    hidden: Node
    ids: Node
    num_experts: int
    group_name: str
    world: int
    order: Node  # argsort of the flat ids
    rows: Node  # hidden[order // K]
    send_counts: Node  # [W, E/W] view of the per-expert counts
    recv_counts: Node  # the buffer the exchanged counts are copied into
    copy: Node  # that copy_
    nodes: list  # the region, in graph order
    module: str
    op: str = "ep_dispatch"
    spelling: str = "argsort + scatter_add counts + all_to_all"

    @property
    def spec(self):
        return _Described(f"E={self.num_experts} over {self.world} ranks (group {self.group_name})")


@dataclass
class CombineMatch:
    rows: Node  # [S, H] rows in `order`
    order: Node  # [S] slot of each row
    weights: Node  # [T, K]
    out: Node  # the sum
    nodes: list
    module: str
    op: str = "ep_combine"
    spelling: str = "index_put unpermute + weighted sum"

    @property
    def spec(self):
        return _Described("sum over k in order, fp32")


@dataclass(frozen=True)
class _Described:
    text: str

    def describe(self) -> str:
        return self.text


def _require(cond, reason, expected=None, actual=None):
    if not cond:
        raise Mismatch(reason, expected, actual)


def _shape(node):
    t = gu.tensor_meta(node)
    return tuple(t.shape) if t is not None else None


def _dtype(node):
    t = gu.tensor_meta(node)
    return t.dtype if t is not None else None


def _only_user(node: Node, what: str) -> Node:
    _require(len(node.users) == 1, f"{node.name} ({what}) is read {len(node.users)} times, not once")
    return next(iter(node.users))


def _is_op(node, *names) -> bool:
    return isinstance(node, Node) and gu.op_name(node) in names


def _group_size(group_name) -> int | None:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group_name).size()
    except Exception:  # noqa: BLE001 -- no process group of that name in this process
        return None


def _match_dispatch(sort: Node, order_of: dict) -> DispatchMatch:
    a = gu.bind(sort, "argsort")
    flat = a["input"]
    _require(not gu.constant(a.get("descending", False)), "the argsort is descending")
    _require(_is_op(flat, "reshape", "view", "flatten"), "the argsort is not over flattened expert ids")
    ids = flat.args[0]
    ids_shape, flat_shape = _shape(ids), _shape(flat)
    _require(ids_shape is not None and len(ids_shape) == 2 and flat_shape is not None and len(flat_shape) == 1,
             "the sorted ids are not a [T, K] tensor flattened", "[T, K] -> [T*K]", f"{ids_shape} -> {flat_shape}")
    _require(gu.is_dim(gu.constant(a["dim"]), 0, 1), "the argsort is not over the flat ids")
    _require(_dtype(ids) in (torch.int64, torch.int32), f"expert ids are {_dtype(ids)}")
    num_tokens, top_k = ids_shape
    # order // K -> hidden[...]: the rows to send
    div = [u for u in sort.users if _is_op(u, "floordiv")]
    _require(len(div) == 1, "the sort order is not divided by K once")
    div = div[0]
    _require(div.args[0] is sort and gu.same_int(gu.constant(div.args[1]), top_k),
             "the sort order is not divided by the top-k", top_k, div.args[1])
    gather = _only_user(div, "token index of each row")
    _require(_is_op(gather, "getitem") and gather.args[1] is div, "the token index does not gather hidden rows")
    hidden = gather.args[0]
    h_shape = _shape(hidden)
    _require(h_shape is not None and len(h_shape) == 2 and gu.same_int(h_shape[0], num_tokens),
             "the gathered hidden states are not [T, H]", f"[{num_tokens}, H]", h_shape)
    _require(_dtype(hidden) in _FLOAT_DTYPES, f"hidden states are {_dtype(hidden)}")
    # zeros(E).scatter_add_(0, flat, ones_like(flat)).view(W, E / W): the per-expert counts
    adds = [u for u in flat.users if _is_op(u, "scatter_add_", "scatter_add")]
    _require(len(adds) == 1, "the flat ids are not counted per expert by one scatter_add")
    add = adds[0]
    _require(len(add.args) == 4 and not add.kwargs and gu.constant(add.args[1]) == 0 and add.args[2] is flat,
             "the per-expert count is not scatter_add(0, ids, ones)")
    zeros, ones = add.args[0], add.args[3]
    _require(_is_op(ones, "ones_like") and ones.args[0] is flat and ones.kwargs.get("dtype") in (None, torch.int64),
             "the counted value is not ones_like(ids)")
    _require(_is_op(zeros, "zeros") and _dtype(zeros) == torch.int64 and len(_shape(zeros)) == 1,
             "the count buffer is not a zero int64 vector")
    num_experts = _shape(zeros)[0]
    _require(isinstance(num_experts, int), "the expert count is symbolic")
    _require(set(zeros.users) == {add}, "the count buffer is read outside the count")
    _require(set(flat.users) <= {sort, add, ones}, "the flat ids are read outside the dispatch")
    _require(set(ones.users) == {add}, "ones_like(ids) is read outside the count")
    counts = _only_user(add, "per-expert counts")
    c_shape = _shape(counts)
    _require(_is_op(counts, "view", "reshape") and c_shape is not None and len(c_shape) == 2,
             "the per-expert counts are not viewed [ranks, local experts]")
    world, e_local = c_shape
    _require(isinstance(world, int) and world * e_local == num_experts, "the count view does not split the experts",
             num_experts, c_shape)
    # the exchange: recv = empty_like(counts); recv.copy_(wait(all_to_all_single(counts, [1]*W, [1]*W, group)))
    a2a = [u for u in counts.users if _is_op(u, "all_to_all_single")]
    _require(len(a2a) == 1, "the counts are not exchanged by one all_to_all_single")
    a2a = a2a[0]
    _require(len(a2a.args) == 4 and not a2a.kwargs, "the counts exchange is not a functional all_to_all_single")
    out_splits, in_splits, group_name = gu.constant(a2a.args[1]), gu.constant(a2a.args[2]), a2a.args[3]
    _require(list(out_splits) == [1] * world and list(in_splits) == [1] * world,
             "the counts exchange does not send one row to each rank", [1] * world, (out_splits, in_splits))
    _require(isinstance(group_name, str), "the process group is not named")
    size = _group_size(group_name)
    _require(size == world, f"the count view has {world} ranks, the process group {size}", world, size)
    wait = _only_user(a2a, "the counts all_to_all")
    _require(_is_op(wait, "wait_tensor"), "the counts all_to_all is not waited on")
    copies = [u for u in wait.users if _is_op(u, "copy_")]
    _require(len(copies) == 1 and len(wait.users) == 1 and copies[0].args[1] is wait,
             "the exchanged counts are not copied into a buffer")
    copy = copies[0]
    recv = copy.args[0]
    _require(_is_op(recv, "empty_like") and recv.args[0] is counts and _dtype(recv) == torch.int64,
             "the exchanged counts are not copied into empty_like(counts)")
    _require(not copy.users, "the count copy's result is read")
    _require(all(order_of[u] > order_of[copy] for u in recv.users if u is not copy),
             "the receive buffer is read before the counts arrive")
    nodes = [sort, div, gather, zeros, ones, add, counts, recv, a2a, wait, copy]
    if set(flat.users) <= set(nodes):
        nodes.append(flat)
    nodes.sort(key=order_of.get)
    _require_no_writes_to_inputs(nodes, [hidden, ids])
    end = order_of[nodes[-1]]
    for out in (sort, gather, counts, recv):
        early = [u.name for u in out.users if u not in nodes and order_of[u] < end]
        _require(not early, f"{early[0] if early else ''} reads {out.name} before the dispatch ends")
    for node in nodes:
        if node not in (sort, gather, counts, recv, flat):
            outside = [u.name for u in node.users if u not in nodes]
            _require(not outside, f"dispatch intermediate {node.name} is also read by {outside[:1]}")
    return DispatchMatch(hidden, ids, num_experts, group_name, world, sort, gather, counts, recv, copy, nodes,
                         gu.module_path(sort))


def _match_combine(setitem: Node, order_of: dict) -> CombineMatch:
    buf, index, rows = setitem.args[0], setitem.args[1], setitem.args[2]
    _require(_is_op(buf, "empty_like") and buf.args[0] is rows and len(buf.args) == 1 and not buf.kwargs,
             "the unpermute does not write into empty_like(rows)")
    _require(isinstance(index, Node) and not isinstance(index, (tuple, list)), "the unpermute index is not a tensor")
    r_shape, o_shape = _shape(rows), _shape(index)
    _require(r_shape is not None and len(r_shape) == 2, "the unpermuted rows are not [S, H]", "[S, H]", r_shape)
    _require(o_shape is not None and len(o_shape) == 1 and gu.same_int(o_shape[0], r_shape[0]),
             "the unpermute order is not one index per row", f"[{r_shape[0]}]", o_shape)
    _require(_dtype(index) in (torch.int64, torch.int32), f"the unpermute order is {_dtype(index)}")
    _require(_dtype(rows) in _FLOAT_DTYPES, f"the unpermuted rows are {_dtype(rows)}")
    others = [u for u in buf.users if u is not setitem]
    _require(len(others) == 1 and order_of[others[0]] > order_of[setitem],
             "the unpermuted buffer is read other than by one view after it is filled")
    view = others[0]
    v_shape = _shape(view)
    _require(_is_op(view, "view", "reshape") and v_shape is not None and len(v_shape) == 3
             and gu.same_int(v_shape[2], r_shape[1]), "the unpermuted rows are not viewed [T, K, H]", "[T, K, H]",
             v_shape)
    num_tokens, top_k = v_shape[0], v_shape[1]
    mul = _only_user(view, "the [T, K, H] rows")
    _require(_is_op(mul, "mul") and len(mul.args) == 2 and not mul.kwargs, "the [T, K, H] rows are not weighted")
    w_unsq = mul.args[1] if mul.args[0] is view else mul.args[0]
    _require(_is_op(w_unsq, "unsqueeze") and gu.is_dim(gu.constant(w_unsq.args[1] if len(w_unsq.args) > 1
                                                                    else w_unsq.kwargs.get("dim")), 2, 3),
             "the routing weights are not unsqueezed on the last dim")
    weights = w_unsq.args[0]
    w_shape = _shape(weights)
    _require(w_shape is not None and len(w_shape) == 2 and gu.same_int(w_shape[0], num_tokens)
             and gu.same_int(w_shape[1], top_k), "the routing weights are not [T, K]", (num_tokens, top_k), w_shape)
    _require(_dtype(weights) in _FLOAT_DTYPES, f"routing weights are {_dtype(weights)}")
    total = _only_user(mul, "the weighted rows")
    s = gu.bind(total, "sum")
    _require(_is_op(total, "sum") and s["input"] is mul and gu.is_dim(gu.constant(s["dim"]), 1, 3)
             and not gu.constant(s["keepdim"]) and s.get("dtype") is None, "the weighted rows are not summed over k")
    _require(_dtype(total) == torch.promote_types(_dtype(rows), _dtype(weights)),
             "the combine's dtype is not the rows' and weights' promotion")
    nodes = [buf, setitem, view, w_unsq, mul, total]
    if set(w_unsq.users) != {mul}:
        nodes.remove(w_unsq)
    nodes.sort(key=order_of.get)
    _require_no_writes_to_inputs(nodes, [rows, index, weights])
    return CombineMatch(rows, index, weights, total, nodes, gu.module_path(setitem))


def find_ep_regions(graph: Graph) -> tuple[list, list]:
    """(matches, near misses): every proven dispatch (anchored at an argsort that feeds an all_to_all of
    per-expert counts) and combine (anchored at a buf[order] = rows write into empty_like(rows) read as
    [T, K, H])."""
    order_of = {n: i for i, n in enumerate(graph.nodes)}
    matches, misses = [], []
    for node in list(graph.nodes):
        name = gu.op_name(node)
        try:
            if name == "argsort" and node.op in ("call_function", "call_method"):
                if not _feeds_count_exchange(node):
                    continue
                matches.append(_match_dispatch(node, order_of))
            elif name == "setitem" and node.op == "call_function" and len(node.args) == 3 \
                    and _is_op(node.args[0], "empty_like") and node.args[0].args[:1] == (node.args[2],):
                matches.append(_match_combine(node, order_of))
        except Mismatch as exc:
            misses.append(NearMiss(node, str(exc), gu.module_path(node), exc.expected, exc.actual, 0, [str(exc)]))
    return matches, misses


def _feeds_count_exchange(sort: Node) -> bool:
    """Whether the ids this argsort sorts are also counted into something an all_to_all sends within a few
    steps (count, view, exchange): the dispatch shape, worth a near miss when it fails; a plain argsort
    elsewhere in a model is not."""
    flat = gu.bind(sort, "argsort")["input"]
    if not isinstance(flat, Node):
        return False
    frontier, seen = [u for u in flat.users if u is not sort], set()
    for _depth in range(4):
        following = []
        for node in frontier:
            if node in seen:
                continue
            seen.add(node)
            if gu.op_name(node) == "all_to_all_single":
                return True
            following.extend(node.users)
        frontier = following
    return False
