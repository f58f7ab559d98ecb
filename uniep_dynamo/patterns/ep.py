"""Expert-parallel patterns: the dispatch plan with its count exchange, the token exchange, and the
unpermute-and-combine.

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

Where one graph holds the token all-to-all, the experts (the experts pattern's uniep.moe_experts) and the
all-to-all back -- plain PyTorch EP code like examples/ep_moe.py, not HF's layer, whose all-to-all lands in
another graph than its experts -- the three become torch.ops.uniep.ep_exchange (_match_exchange); elsewhere they
stay where they are. Each rule below checks the constants it binds; a candidate that fails one is left alone
with a near miss. The sort's order is free to change: argsort does not promise one among equal ids,
the combine reads the same order back, and the stable order is the one a single GPU uses.
"""
from __future__ import annotations

import operator
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
    # after a dynamic recompile the returned rows' count is the sum of the split sizes and the order's its own
    # symbol: equal on the traced call, so a guard on their equality proves it for every call the graph runs
    _require(o_shape is not None and len(o_shape) == 1 and gu.same_int_or_guard(o_shape[0], r_shape[0]),
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


@dataclass
class ExchangeMatch:
    """all_to_all(send) -> experts on the received rows -> all_to_all back: the nodes the op replaces."""
    send: Node  # [S, H] rows in the sender's order
    recv_counts: Node  # [W, E_local] rows each source sends to each local expert
    w_up: Node
    w_down: Node
    b_up: Node | None
    b_down: Node | None
    experts_spec: str  # the experts op's spec
    group_name: str
    send_sizes: list  # the all-to-all's input split sizes (ints or SymInt nodes)
    recv_sizes: list  # its output split sizes
    back: Node  # the returned rows (the last wait)
    nodes: list
    module: str
    world: int
    local_experts: int
    op: str = "ep_exchange"
    spelling: str = "all_to_all + experts + all_to_all back"

    @property
    def spec(self):
        return _Described(f"{self.local_experts} local experts over {self.world} ranks, transfers beside the GEMMs")


def _waits_back(node: Node, chain: list) -> Node:
    """Walk back from `node` over wait_tensor nodes and pass-through autograd functions (each read once),
    adding them to `chain`; returns the first node that is neither."""
    while True:
        if _is_op(node, "wait_tensor"):
            _require(len(node.users) == 1, f"the received rows {node.name} are read {len(node.users)} times")
            chain.append(node)
            node = node.args[0]
            continue
        inner = _pass_through_input(node)
        if inner is None:
            return node
        _require(len(node.users) == 1, f"the received rows {node.name} are read {len(node.users)} times")
        chain.extend(_pass_through_nodes(node))
        node = inner


def _waits_forward(node: Node, chain: list) -> Node:
    """Walk forward from `node` while its one reader is a wait_tensor or a pass-through autograd function."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if _is_op(user, "wait_tensor"):
            chain.append(user)
            node = user
        elif gu.op_name(user) == "autograd_function_apply" and len(user.users) == 1:
            get = next(iter(user.users))
            if _pass_through_input(get) is not node:
                break
            chain.extend(_pass_through_nodes(get))
            node = get
        else:
            break
    return node


def _pass_through_input(node: Node):
    """x, if `node` is getitem(autograd_function_apply(fwd, bwd, x), 0) of an autograd.Function whose forward
    only waits on x and whose backward passes the gradient through (how torch 2.11's
    all_to_all_single_autograd wraps its result, _FromTorchTensor); else None."""
    if not (_is_op(node, "getitem") and node.args[1] == 0):
        return None
    apply = node.args[0]
    if not (isinstance(apply, Node) and gu.op_name(apply) == "autograd_function_apply" and len(apply.users) == 1):
        return None
    fwd, bwd, *inputs = apply.args
    # with dynamic shapes Dynamo also passes the sizes' symbols in
    tensors = [a for a in inputs if gu.tensor_meta(a) is not None]
    if len(tensors) != 1 or any(not isinstance(gu.example(a), (int, torch.SymInt)) for a in inputs
                                if a is not tensors[0]):
        return None
    owner = apply.graph.owning_module
    bodies = [getattr(owner, b.target, None) if isinstance(b, Node) and b.op == "get_attr" and owner is not None
              else None for b in (fwd, bwd)]
    if not all(isinstance(b, torch.fx.GraphModule) for b in bodies) or not _passes_through(bodies[0], False) \
            or not _passes_through(bodies[1], True):
        return None
    return tensors[0]


def _pass_through_nodes(get: Node) -> list:
    apply = get.args[0]
    return [get, apply] + [b for b in apply.args[:2] if isinstance(b, Node) and len(b.users) == 1]


def _passes_through(body: torch.fx.GraphModule, backward: bool) -> bool:
    """Whether the body returns its tensor input (forward; its sizes' symbols may come in and go out as saved
    values) or its incoming gradient (backward: the first input), through wait_tensor calls only, and computes
    nothing else (Dynamo brackets an autograd.Function's body with grad-mode switches)."""
    nodes = list(body.graph.nodes)
    if any(n.op not in ("placeholder", "output") and not _is_op(n, "wait_tensor", "_set_grad_enabled")
           for n in nodes):
        return False
    result = next(n for n in nodes if n.op == "output").args[0]
    while isinstance(result, (tuple, list)) and result:
        # the forward's (outputs, saved); the backward's one gradient per input, None for the sizes
        given = [r for r in result if r is not None]
        if len(given) != 1 and not isinstance(result[0], (tuple, list)):
            return False
        result = result[0] if isinstance(result[0], (tuple, list)) or len(given) != 1 else given[0]
    while _is_op(result, "wait_tensor"):
        result = result.args[0]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if backward:
        return bool(placeholders) and result is placeholders[0]
    sizes = (int, torch.SymInt)
    return result in placeholders and all(isinstance(gu.example(p), sizes) for p in placeholders if p is not result) \
        and not isinstance(gu.example(result), sizes)


def _same_sizes(a, b) -> bool:
    if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)) or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        try:
            if not gu.same_int(gu.constant(x), gu.constant(y)):
                return False
        except gu.NotConstant:
            return False
    return True


def _match_exchange(call: Node, order_of: dict) -> ExchangeMatch:
    """Anchored at a uniep.moe_experts call (the experts rewrite ran first) whose rows come straight from an
    all_to_all_single and whose result goes straight back through one with the split sizes swapped."""
    from ..spec import decode_spec

    _require(len(call.args) == 9 and all(v is None for v in call.kwargs.values()),
             "the experts call takes a routing plan")
    x, ids, weights, w_up, w_down, b_up, b_down, post_operands, spec = call.args
    _require(not post_operands and decode_spec(spec).post is None, "the experts have a post-expert program")
    # the return: getitem(call, 0) -> all_to_all_single -> wait(s)
    _require(len(call.users) == 1, "the experts op's saved outputs are read")
    out = next(iter(call.users))
    _require(_is_op(out, "getitem") and out.args[1] == 0, "the experts op's output is not read once")
    back_a2a = _only_user(out, "the experts' rows")
    _require(_is_op(back_a2a, "all_to_all_single") and back_a2a.args[0] is out and len(back_a2a.args) == 4
             and not back_a2a.kwargs, "the experts' rows do not go back through a functional all_to_all_single")
    back_waits = []
    back = _waits_forward(back_a2a, back_waits)
    _require(any(_is_op(n, "wait_tensor") for n in back_waits), "the return all_to_all is not waited on")
    # the arrival: all_to_all_single -> wait(s) -> the experts' rows
    _require(set(x.users) == {call}, f"the received rows {x.name} are read outside the experts")
    in_waits = []
    a2a = _waits_back(x, in_waits)
    _require(any(_is_op(n, "wait_tensor") for n in in_waits), "the received rows are not waited on")
    _require(_is_op(a2a, "all_to_all_single") and len(a2a.args) == 4 and not a2a.kwargs,
             "the experts' rows do not come from a functional all_to_all_single")
    _require(len(a2a.users) == 1, "the all_to_all's result is read twice")
    send, recv_sizes, send_sizes, group_name = a2a.args
    _require(isinstance(group_name, str) and back_a2a.args[3] == group_name,
             "the two all_to_alls are not over one named process group")
    _require(_same_sizes(back_a2a.args[1], send_sizes) and _same_sizes(back_a2a.args[2], recv_sizes),
             "the return all_to_all does not swap the dispatch's split sizes")
    world = len(send_sizes)
    size = _group_size(group_name)
    _require(size == world, f"the split sizes name {world} ranks, the process group {size}", world, size)
    s_shape = _shape(send)
    _require(s_shape is not None and len(s_shape) == 2 and _dtype(send) in _FLOAT_DTYPES,
             "the sent rows are not a floating [S, H] tensor", "[S, H]", s_shape)
    # the local expert of each received row: arange(E_local).repeat(W).repeat_interleave(recv_counts.reshape(-1))
    local_experts = _shape(w_up)[0] if _shape(w_up) else None
    _require(_is_op(ids, "unsqueeze") and gu.is_dim(gu.constant(ids.args[1] if len(ids.args) > 1
                                                                 else ids.kwargs.get("dim")), 1, 2),
             "the local expert ids are not a column")
    rep = ids.args[0]
    _require(_is_op(rep, "repeat_interleave") and len(rep.args) == 2 and set(rep.kwargs) <= {"output_size"},
             "the local expert ids are not a repeat_interleave of expert numbers by counts")
    base, reps = rep.args
    _require(_is_op(base, "repeat") and len(base.args) == 2 and not base.kwargs
             and gu.same_int(gu.constant(base.args[1]), world), "the expert numbers are not repeated once per rank")
    ar = base.args[0]
    _require(_is_op(ar, "arange") and len(ar.args) == 1 and set(ar.kwargs) <= {"device", "dtype"}
             and ar.kwargs.get("dtype") in (None, torch.int64) and local_experts is not None
             and gu.same_int(gu.constant(ar.args[0]), local_experts),
             "the expert numbers are not arange(local experts)", local_experts, ar.args[:1])
    _require(_is_op(reps, "reshape", "view", "flatten") and (_is_op(reps, "flatten") or
                                                           list(gu.constant(reps.args[1:])) in ([-1], [[-1]], [(-1,)])),
             "the repeat counts are not the received counts flattened")
    recv_counts = reps.args[0]
    c_shape = _shape(recv_counts)
    _require(c_shape is not None and len(c_shape) == 2 and gu.same_int(c_shape[0], world)
             and gu.same_int(c_shape[1], local_experts) and _dtype(recv_counts) == torch.int64,
             "the received counts are not an int64 [ranks, local experts] tensor", (world, local_experts), c_shape)
    _require(_is_op(weights, "ones_like") and weights.args[0] is ids and len(weights.args) == 1
             and set(weights.kwargs) <= {"dtype"} and weights.kwargs.get("dtype") == _dtype(send),
             "the experts' routing weights are not ones_like(ids) in the rows' dtype")
    _require(set(ids.users) == {call, weights} and set(weights.users) == {call},
             "the local expert ids or weights are read outside the experts")
    for node in (ar, base, rep):
        _require(len(node.users) == 1, f"{node.name} is read outside the local expert ids")
    nodes = [a2a, *in_waits, ar, base, rep, ids, weights, call, out, back_a2a, *back_waits]
    if len(reps.users) == 1:
        nodes.append(reps)
    nodes.sort(key=order_of.get)
    _require_no_writes_to_inputs(nodes, [send, recv_counts, w_up, w_down, b_up, b_down])
    return ExchangeMatch(send, recv_counts, w_up, w_down, b_up, b_down, spec, group_name, list(send_sizes),
                         list(recv_sizes), back, nodes, gu.module_path(call), world, local_experts)


def find_ep_regions(graph: Graph, exchange: bool = True) -> tuple[list, list]:
    """(matches, near misses): every proven dispatch (anchored at an argsort that feeds an all_to_all of
    per-expert counts), exchange (anchored at a uniep.moe_experts call whose rows come from an all-to-all;
    only with ``exchange``) and combine (anchored at a buf[order] = rows write into empty_like(rows) read
    as [T, K, H])."""
    order_of = {n: i for i, n in enumerate(graph.nodes)}
    matches, misses = [], []
    for node in list(graph.nodes):
        name = gu.op_name(node)
        try:
            if name == "argsort" and node.op in ("call_function", "call_method"):
                if not _feeds_count_exchange(node):
                    continue
                matches.append(_match_dispatch(node, order_of))
            elif node.op == "call_function" and node.target is torch.ops.uniep.moe_experts.default \
                    and exchange and _feeds_from_all_to_all(node):
                matches.append(_match_exchange(node, order_of))
            elif name == "setitem" and node.op == "call_function" and len(node.args) == 3 \
                    and _is_op(node.args[0], "empty_like") and node.args[0].args[:1] == (node.args[2],):
                matches.append(_match_combine(node, order_of))
        except Mismatch as exc:
            misses.append(NearMiss(node, str(exc), gu.module_path(node), exc.expected, exc.actual, 0, [str(exc)]))
    return matches, misses


def _feeds_from_all_to_all(call: Node) -> bool:
    """Whether the experts call's rows come (through waits) from an all_to_all_single: the exchange shape,
    worth a near miss when it fails."""
    try:
        return _is_op(_waits_back(call.args[0], []), "all_to_all_single")
    except Mismatch:
        return True


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


# ---- the whole layer in one graph ----------------------------------------------------------------------------------

@dataclass
class LayerMatch:
    """uniep.ep_dispatch -> uniep.ep_exchange -> uniep.ep_combine in ONE graph, which the rewrites above made where
    Dynamo traced the layer's split sizes as unbacked ints (``capture_scalar_outputs``) and so kept the whole layer
    in one graph: the three become one uniep.ep_layer, whose plan may stay on the device (no host read of the
    counts). ``nodes``: the three calls, their outputs, and the host reads of the counts that fed nothing but the
    exchange's split sizes (with their runtime asserts), in graph order."""
    hidden: Node
    ids: Node
    weights: Node
    w_up: Node
    w_down: Node
    b_up: Node | None
    b_down: Node | None
    experts_spec: str
    group_name: str
    world: int
    knobs: str
    sequential: bool
    out: Node  # the combine call
    calls: tuple  # (ep_dispatch, ep_exchange, ep_combine) calls
    nodes: list
    module: str
    op: str = "ep_layer"
    spelling: str = "ep_dispatch + ep_exchange + ep_combine in one graph, split sizes traced"

    @property
    def spec(self):
        return _Described(f"{self.world} ranks (group {self.group_name}), the plan and split sizes inside the op")


# what may read the counts on their way to the exchange's split sizes (besides the exchange): host reads, sums,
# indexing, symbolic arithmetic on the sizes read, and the runtime asserts Dynamo put on them; nothing that writes
_SIZE_METHODS = {"item", "tolist", "sum", "__getitem__", "view", "reshape"}
# the steps among them that check the sizes (raise where a check fails)
_SIZE_CHECKS = {torch._check, torch._check_is_size, torch.ops.aten._assert_scalar.default,
                torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten.sym_constrain_range.default}
_SIZE_FUNCTIONS = {torch.stack, torch.sum, torch.sym_sum, torch.sym_not, torch.sym_max, torch.sym_min,
                   torch.sym_int, torch.sym_float, torch.ops.aten._local_scalar_dense.default} | _SIZE_CHECKS


def _require_no_model_checks(steps: set, send_sizes: list, recv_sizes: list, rows) -> None:
    """Every size check among ``steps`` must go with the layer without changing what the model does: one Dynamo put
    on the host reads when it traced them (it carries the read's source line; a ``torch._check`` the model calls
    carries its own), stating what the replaced ops hold (a size >= 0, a sent size <= the T*K rows, the sent sizes
    summing to them), what tracing the experts' views assumed of the received rows (their sum not 0, a multiple
    of it), which the one op does not need: it takes a rank that receives nothing, or what follows from the sent
    sizes summing to the T*K rows and the input shapes' guarded ranges (at one rank, ``u0 >= 4`` with u0 = 2*T).
    Any other check, say a Python ``assert`` on a size, which Dynamo turns into a check of that kind on the read, is
    the model's own and would be dropped with the sizes: the layer then stays three ops.

    A runtime assert is judged by the expression Dynamo stated when it made it (its message: ``Eq(u1, 80)``), over
    the reads' own symbols, not by its condition's value in the graph: Dynamo substitutes what a check asserts into
    the symbols (a Python ``assert recv_sizes[0] == 80`` makes u1 = 80), after which that condition reads True."""
    import sympy

    reads = {n.meta.get("stack_trace") for n in steps if gu.op_name(n) in ("item", "_local_scalar_dense", "tolist")}
    env = _shape_env(rows, steps)
    send, recv = (_read_symbols(sizes) for sizes in (send_sizes, recv_sizes))
    total = _sym_expr(gu.tensor_meta(rows).shape[0] if gu.tensor_meta(rows) is not None else None)
    _require(None not in send and None not in recv and total is not None, "the split sizes are not traced symbols")
    sent, received = sympy.Add(*send), sympy.Add(*recv)
    held = {sympy.Eq(sent, total), sympy.Ne(received, 0)} | {sympy.Ge(u, 0) for u in send + recv} | \
        {sympy.Le(u, total) for u in send}
    held -= {sympy.true, sympy.false}  # never a check's stand-in: a condition Dynamo substituted reads True
    names = _check_names(send + recv, env)
    equal = {send[0]: total} if len(send) == 1 else {}  # one rank: its one sent size is the T*K rows
    for node in steps:
        if not (node.op == "call_function" and node.target in _SIZE_CHECKS):
            continue
        trace = node.meta.get("stack_trace")
        _require(trace is not None and trace in reads,
                 f"the model checks its split sizes ({node.name}, {_last_line(trace)}): that check would be dropped "
                 "with them")
        if node.target is torch.ops.aten._assert_scalar.default:
            expr = _stated_check(node, names)
        else:
            expr = _sym_expr(gu.example(node.args[0]) if node.args else None)
            if node.target in (torch._check_is_size, torch.ops.aten.sym_constrain_range_for_size.default):
                expr = sympy.Ge(expr, 0) if expr is not None else None  # size-like: >= 0
            elif node.target is torch._check:  # the model's own: never the op's to drop (its trace is the read's
                expr = None                    # only where the model wrote it on that line)
        ok = expr is not None and (expr == sympy.true or expr in held
                                   or getattr(expr, "reversed", None) in held  # 48 >= u0 is u0 <= 48
                                   or _multiple_of(expr, received)
                                   or _implied_by_input_shapes(expr, equal, env))
        _require(ok, f"the model checks its split sizes ({node.name}: {expr}): that check would be dropped with them")


def _shape_env(rows, steps):
    """The ShapeEnv of the graph's symbols (from the rows' fake tensor, or any symbolic step), or None."""
    fake = gu.example(rows)
    env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
    for node in steps:
        if env is not None:
            break
        env = getattr(getattr(gu.example(node), "node", None), "shape_env", None)
    return env


def _read_symbols(sizes: list) -> list:
    """The unbacked symbol each host read of a size made (its node's ``unbacked_bindings``), or None."""
    out = []
    for size in sizes:
        bindings = size.meta.get("unbacked_bindings") if isinstance(size, Node) else None
        out.append(next(iter(bindings)) if bindings and len(bindings) == 1 else None)
    return out


def _check_names(reads: list, env) -> dict:
    """The names an ``_assert_scalar``'s message may use (_stated_check): torch's sympy functions, the shape
    environment's backed symbols, and the reads' own unbacked ones."""
    from torch.utils._sympy import functions

    names = {name: getattr(functions, name) for name in ("Mod", "PythonMod", "FloorDiv", "CeilDiv", "CleanDiv",
                                                          "Max", "Min", "IntTrueDiv", "FloorToInt", "CeilToInt",
                                                          "TruncToInt") if hasattr(functions, name)}
    if env is not None:
        backed = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # renamed in 2.11+
        names.update({str(sym): sym for sym in backed})
    names.update({str(u): u for u in reads})
    return names


def _stated_check(node: Node, names: dict):
    """The sympy expression an ``_assert_scalar`` checks as Dynamo stated it (its message), over ``names``
    (_check_names); None where the message cannot be read."""
    import re

    import sympy

    message = node.args[1] if len(node.args) > 1 else node.kwargs.get("assert_msg")
    stated = re.match(r"Runtime assertion failed for expression (.+) on node '[^']*'$", message or "", re.S)
    if stated is None:
        return None
    try:
        return sympy.sympify(stated.group(1), locals=names)
    except Exception:  # noqa: BLE001  (anything sympy cannot read: not proven)
        return None


def _implied_by_input_shapes(expr, equal: dict, env) -> bool:
    """Whether a check, with the sizes that the op holds equal to an expression of the input shapes replaced by it
    (``equal``: at one rank the sent size is the T*K rows), is a statement about the graph's input shapes alone (no
    unbacked symbol left) that the shape environment proves from their ranges, which Dynamo's guards hold (a dynamic
    size is at least 2). At one rank, say, Dynamo checks the sent size u0 >= 4 in the compile for a second token
    count: 2*T >= 4, true of every input the graph takes."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if env is None or not isinstance(expr, sympy.Basic):
        return False
    expr = expr.xreplace(equal)
    if free_unbacked_symbols(expr):
        return False
    try:
        return env._maybe_evaluate_static(expr) == sympy.true
    except Exception:  # noqa: BLE001  (a private ShapeEnv method: anything it raises means not proven)
        return False


def _sym_expr(value):
    """The sympy expression of an int, SymInt or SymBool (None for anything else)."""
    import sympy

    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    node = getattr(value, "node", None)
    return getattr(node, "expr", None)


def _multiple_of(expr, received) -> bool:
    """``Eq(Mod(c * received, received), 0)``: tracing a view of the received rows by their count."""
    import sympy

    # torch's own Mod classes (torch.utils._sympy.functions) stand beside sympy's
    if not (isinstance(expr, sympy.Eq) and expr.rhs == 0 and type(expr.lhs).__name__ in ("Mod", "PythonMod")
            and len(expr.lhs.args) == 2):
        return False
    a, b = expr.lhs.args
    return sympy.simplify(b - received) == 0 and sympy.simplify(a / received).is_number


def _last_line(trace) -> str:
    lines = [line.strip() for line in (trace or "").splitlines() if line.strip() and set(line.strip()) != {"^"}]
    return lines[-1] if lines else "no source line"


def _is_device_move(node) -> bool:
    """A copy of the counts to another device that keeps their values: ``.cpu()``, or ``.to(device)`` (torchtitan's
    ``.to(torch.device("cpu"), non_blocking=True)`` before its ``.tolist()``), with no dtype change but to int64."""
    if not (isinstance(node, Node) and node.op == "call_method" and node.target in ("cpu", "to") and node.args):
        return False
    if node.target == "cpu":
        return len(node.args) == 1 and set(node.kwargs) <= {"memory_format"}
    rest = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k in ("device", "dtype")]
    if set(node.kwargs) - {"device", "dtype", "non_blocking", "copy"}:
        return False
    return all(isinstance(a, (torch.device, str)) or a is torch.int64 for a in rest)


def _unmoved(node):
    """The counts ``node`` copies, through any device moves (_is_device_move)."""
    while _is_device_move(node):
        node = node.args[0]
    return node


def _is_size_step(node: Node) -> bool:
    if _is_device_move(node):
        return True
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    return target in _SIZE_FUNCTIONS or (getattr(target, "__module__", None) in ("_operator", "operator")
                                         and target is not operator.setitem and not target.__name__.startswith("i"))


def _outputs(call: Node) -> dict:
    """index -> the getitem reading that output of a uniep op's call; Mismatch if it is read any other way."""
    outs = {}
    for user in call.users:
        _require(_is_op(user, "getitem") and isinstance(user.args[1], int) and user.args[1] not in outs,
                 f"{call.name}'s outputs are read other than once each")
        outs[user.args[1]] = user
    return outs


def _summed_counts(size, counts: dict):
    """(which, rank) for a split size that is ``counts[which][rank]`` summed over the local experts and read on the
    host -- ``c.sum(dim=1).tolist()[rank]``, or through ``stack([send.sum(1), recv.sum(1)]).tolist()``, with any
    copies to another device on the way (``.to("cpu", non_blocking=True)``: _is_device_move) -- where
    ``counts`` maps the dispatch's send and received count outputs to "send" and "recv"; Mismatch otherwise."""
    _require(isinstance(size, Node) and gu.op_name(size) in ("item", "_local_scalar_dense"),
             "a split size is not a count read on the host")
    element = size.args[0]
    _require(_is_op(element, "getitem") and isinstance(element.args[1], int), "a split size is not one element")
    rank, source = element.args[1], _unmoved(element.args[0])
    if _is_op(source, "getitem") and _is_op(_unmoved(source.args[0]), "stack"):
        stack, row = _unmoved(source.args[0]), source.args[1]
        parts = gu.bind(stack, "stack").get("input")
        dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
        _require(isinstance(row, int) and isinstance(parts, (list, tuple)) and 0 <= row < len(parts) and dim == 0,
                 "the split sizes' stack is not read by row")
        source = _unmoved(parts[row])
    _require(_is_op(source, "sum"), "a split size is not a sum of the per-expert counts")
    s = gu.bind(source, "sum")
    _require(s["input"] in counts and gu.is_dim(gu.constant(s["dim"]), 1, 2) and not s["keepdim"]
             and s["dtype"] is None, "a split size is not the sum of a rank's per-expert counts")
    return counts[s["input"]], rank


def _exchange_of(dispatch: Node) -> Node | None:
    """The uniep.ep_exchange call in this graph that reads the dispatch's rows, or None (the layer's other graph)."""
    for rows in dispatch.users:
        if _is_op(rows, "getitem") and rows.args[1] == 0:
            for user in rows.users:
                if user.op == "call_function" and user.target is torch.ops.uniep.ep_exchange.default:
                    return user
    return None


def _match_layer(dispatch: Node, exchange: Node, order_of: dict) -> LayerMatch:
    hidden, ids, num_experts, world, group_name, gather_counts = dispatch.args
    d = _outputs(dispatch)
    _require(gather_counts and set(d) == {0, 1, 2, 3}, "the dispatch does not hand its count table to the exchange")
    _require(set(d[0].users) == {exchange} and exchange.args[0] is d[0] and exchange.args[1] is d[3],
             "the dispatched rows or counts go elsewhere than the exchange")
    send, recv_counts, w_up, w_down, b_up, b_down, spec, x_group, send_sizes, recv_sizes, knobs, sequential = \
        exchange.args
    _require(x_group == group_name and len(send_sizes) == len(recv_sizes) == world,
             "the exchange is over another group than the dispatch")
    x = _outputs(exchange)
    _require(set(x) == {0} and len(x[0].users) == 1, "the exchanged rows are read outside one combine")
    combine = next(iter(x[0].users))
    _require(combine.target is torch.ops.uniep.ep_combine.default and combine.args[0] is x[0]
             and combine.args[1] is d[1] and set(d[1].users) == {combine},
             "the exchanged rows do not go to the combine in the dispatch's order")
    counts = {d[2]: "send", d[3]: "recv"}
    for which, sizes in (("send", send_sizes), ("recv", recv_sizes)):
        for rank, size in enumerate(sizes):
            got = _summed_counts(size, counts)
            _require(got == (which, rank), f"the exchange's {which} size {rank} is not rank {rank}'s {which} count",
                     (which, rank), got)
    # every reader of the counts but the exchange: size steps read by nothing outside them (Dynamo's asserts on the
    # read sizes included), which go with the layer
    steps, frontier = set(), [u for c in (d[2], d[3]) for u in c.users if u is not exchange]
    while frontier:
        node = frontier.pop()
        if node in steps:
            continue
        _require(_is_size_step(node), f"the counts reach {node.name} ({gu.op_name(node) or node.op}), not only the "
                 "exchange's split sizes")
        steps.add(node)
        frontier.extend(u for u in node.users if u is not exchange)
    _require_no_model_checks(steps, send_sizes, recv_sizes, d[0])
    calls = (dispatch, exchange, combine)
    nodes = sorted({*calls, *d.values(), *x.values(), *steps}, key=order_of.get)
    return LayerMatch(hidden, ids, combine.args[2], w_up, w_down, b_up, b_down, spec, group_name, world, knobs,
                      sequential, combine, calls, nodes, gu.module_path(exchange))


def find_layers(graph: Graph) -> tuple[list, list]:
    """(matches, reasons): each uniep.ep_dispatch whose rows, counts and order go to an ep_exchange and ep_combine in
    this graph, as one LayerMatch; (dispatch node, why not) for those whose rows reach an exchange here but are not
    one layer. Run after the EP rewrites (the calls are theirs)."""
    order_of = {n: i for i, n in enumerate(graph.nodes)}
    matches, reasons = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.uniep.ep_dispatch.default:
            exchange = _exchange_of(node)
            if exchange is None:
                continue
            try:
                matches.append(_match_layer(node, exchange, order_of))
            except Mismatch as exc:
                reasons.append((node, str(exc)))
    return matches, reasons
