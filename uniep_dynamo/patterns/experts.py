"""The experts pattern: find routed-expert MLP regions in a Dynamo graph and prove what they compute.

``interpreter.py`` gives every node its abstract value (``values.py``), checking each constant an op
binds. A region is proposed wherever the value ``Combined`` appears
(sum over k of weighted expert outputs in slot order); ``check_region`` then proves the whole
expression is ``sum_k w[t,k] * down_e(gate(up_e(x_t)))`` for weight tensors of the right shapes and dtype
(parameters, buffers, or weights computed in the forward, as PEFT's LoRA on expert parameters computes them) and
that no intermediate escapes. Both HF spellings (``grouped_mm``: sort + grouped GEMMs + inverse
permutation; ``batched_mm``: repeat_interleave + per-slot weight gathers + bmm) and the common
hand-written variants reduce to the same values, so one pattern serves every family.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..kernels import gate_program
from ..kernels.reference import SUPPORTED_DTYPES
from ..spec import ExpertsSpec
from . import graph_utils as gu
from . import split
from .autocast import AutocastView, describe, device_type
from .interpreter import ANCHOR_OPS, Interpreter, _dtype, _dtype_name, _ndim
from .programs import _gate_program, _post_program
from .values import Combined, ExpertsMatch, Halves, Mismatch, NearMiss, Rows


def _shape(node):
    t = gu.tensor_meta(node)
    return tuple(t.shape) if t is not None else None


def _require(cond, message, expected=None, actual=None):
    if not cond:
        raise Mismatch(message, expected, actual)


def _out_of_range_mode(bounds: list, num_experts, spelling: str) -> str:
    """How the graph treats expert ids outside [0, E): every bound it applies must be E's."""
    clamped = False
    for bound in bounds:
        if bound[0] == "clamp":
            _, lo, hi = bound
            if lo not in (None, 0) or not gu.same_int(hi, num_experts - 1):
                raise Mismatch(f"expert ids are clamped to [{lo}, {hi}], not [0, {num_experts - 1}]")
            clamped = True
        elif not gu.same_int(bound[1], num_experts if bound[0] == "ge" else num_experts - 1):
            raise Mismatch(f"expert ids are compared ({bound[0]}) against {bound[1]}, not the expert count")
    # batched_mm gathers weights with the clamped ids, so a clamped slot is computed; grouped_mm never
    # computes rows past the last expert's offset (and HF zeroes them), so they drop out.
    return "clamp" if clamped and spelling == "batched_mm" else "drop"


def check_region(root: Node, value: Combined, interp: "Interpreter") -> ExpertsMatch:
    """Prove that `value` is sum_k w[t,k] * down_e(gate(up_e(x_t))) over weight tensors of the right shapes."""
    expr = value.expr
    _require(expr[0] == "weighted", "the combined slots are not multiplied by the routing weights")
    _, rows_expr, weights = expr
    post_operands: list = []  # the op's extra tensor inputs, shared by the post and the gate program
    post, down_expr = _post_program(rows_expr, post_operands)
    b_down = None
    if down_expr[0] == "bias":
        _, down_expr, b_down = down_expr
    _require(down_expr[0] == "lin", "the weighted rows are not the output of the down projection")
    _, act_expr, w_down, down_layout = down_expr
    gate, up_expr = _gate_program(act_expr, post_operands)
    b_up = None
    if up_expr[0] == "bias":
        _, up_expr, b_up = up_expr
    _, x_expr, w_up, up_layout = up_expr
    _require(x_expr[0] == "x", "the up projection's input is not the token hidden states")
    hidden, ids = x_expr[1], value.ids
    _require(ids is not None, "no expert ids found for the routed rows")

    h_shape, ids_shape, w_shape = _shape(hidden), _shape(ids), _shape(weights)
    h_dtype = _dtype(hidden)
    _require(h_dtype in SUPPORTED_DTYPES, f"hidden states are {_dtype_name(h_dtype)}; supported dtypes are "
                                          "float32, float16, bfloat16", "float32, float16 or bfloat16",
             _dtype_name(h_dtype))
    for node in (w_up, w_down):
        _require(_dtype(node) == h_dtype, f"expert weights are {_dtype_name(_dtype(node))} but hidden states "
                                          f"are {_dtype_name(h_dtype)} (mixed precision is not supported)")
    for name, node in (("up", b_up), ("down", b_down)):
        if node is not None:
            _require(_dtype(node) == h_dtype, f"the {name} expert bias is {_dtype_name(_dtype(node))}")
    _require(_dtype(weights) is not None and _dtype(weights).is_floating_point, "routing weights are not floating point")
    _require(len(h_shape) == 2 and len(ids_shape) == 2 and len(w_shape) == 2, "hidden, ids and weights must be 2-D")
    tokens, hidden_size = h_shape
    _require(gu.same_int_or_guard(ids_shape[0], tokens) and gu.same_int_or_guard(w_shape[0], tokens),
             f"hidden states {h_shape}, expert ids {ids_shape} and routing weights {w_shape} disagree on tokens")
    _require(gu.same_int(ids_shape[1], value.top_k) and gu.same_int(w_shape[1], value.top_k),
             f"expert ids {ids_shape} and routing weights {w_shape} do not have K={value.top_k} columns")

    up_shape, down_shape = _shape(w_up), _shape(w_down)
    _require(len(up_shape) == 3 and len(down_shape) == 3, "expert weights must be 3-D [E, ., .]")
    num_experts = up_shape[0]
    _require(gu.same_int(down_shape[0], num_experts), f"up weight {up_shape} and down weight {down_shape} differ in E")
    up_out, up_in = (up_shape[1], up_shape[2]) if up_layout == "oi" else (up_shape[2], up_shape[1])
    down_out, down_in = (down_shape[1], down_shape[2]) if down_layout == "oi" else (down_shape[2], down_shape[1])
    _require(gu.same_int(up_in, hidden_size) and gu.same_int(down_out, hidden_size),
             f"expert weights {up_shape} / {down_shape} do not map hidden size {hidden_size}",
             f"up weight {'[E, N, H]' if up_layout == 'oi' else '[E, H, N]'} and down weight "
             f"{'[E, H, I]' if down_layout == 'oi' else '[E, I, H]'} with H={hidden_size}",
             f"up {list(up_shape)}, down {list(down_shape)}")
    split = gate_program.decode(gate)[0]
    act_width = up_out if split == "none" else up_out // 2
    _require(gu.same_int(act_width, down_in), f"the gate yields {act_width} features, the down weight takes {down_in}")
    if b_up is not None:
        _require(_shape(b_up) == (num_experts, up_out), f"up bias {_shape(b_up)} is not [E, {up_out}]")
    if b_down is not None:
        _require(_shape(b_down) == (num_experts, hidden_size), f"down bias {_shape(b_down)} is not [E, {hidden_size}]")
    out_dtype = value.dtype
    _require(out_dtype in SUPPORTED_DTYPES, f"the combined output is {_dtype_name(out_dtype)}")

    env = interp.env
    nodes = region_nodes(root, env)
    members = set(nodes)
    for node in nodes:
        outside = [u for u in node.users if u not in members]
        if node is not root and outside:
            raise Mismatch(f"intermediate {node.name} is also used by {outside[0].name}, outside the experts region")
    inputs = [hidden, ids, weights, w_up, w_down, b_up, b_down] + post_operands
    # the op replaces the region's nodes, so none of its inputs (weights computed in the forward included) may be one
    inside = [n for n in inputs if isinstance(n, Node) and n in members]
    _require(not inside, f"{inside[0].name if inside else ''}, an input of the experts op, is computed inside the region")
    _require_no_writes_to_inputs(nodes, inputs)
    spelling = "batched_mm" if any(gu.op_name(n) == "bmm" for n in nodes) else "grouped_mm"
    out_of_range = _out_of_range_mode(interp.id_bounds.get(ids, []), num_experts, spelling)
    for operand in post_operands:
        if _ndim(operand) == 1 and not gu.same_int(_shape(operand)[0], hidden_size):
            raise Mismatch(f"post-projection vector {operand.name} has {_shape(operand)[0]} entries, not "
                           f"H={hidden_size}", f"[{hidden_size}]", list(_shape(operand)))
    compute_dtype, out_dtype, out_cast = _autocast_dtypes(nodes, interp, hidden, weights, (("up", b_up), ("down", b_down)))
    spec = ExpertsSpec(up_layout, down_layout, gate, out_dtype, out_of_range, post)
    return ExpertsMatch(root, nodes, hidden, ids, weights, w_up, w_down, b_up, b_down, spec,
                        gu.module_path(root), spelling, post_operands, compute_dtype, out_cast)


def _input_rows(expr) -> bool:
    """Rows the GEMMs read as they come (the token's hidden state, possibly cast) or gathered per slot."""
    while expr[0] == "ew" and expr[1] == "to":
        expr = expr[2][0]
    return expr[0] in ("x", "eid", "W", "B", "w", "weighted")


def _autocast_dtypes(nodes, interp, hidden, weights, biases):
    """(compute dtype, op output dtype, cast after the op) of a region that may run under autocast.

    The GEMMs' recorded output dtype is the dtype eager computes them in: under autocast, `bmm` (and
    `linear`, `matmul`) cast fp32 inputs to the autocast dtype, while HF's `grouped_mm_fallback` custom op and
    `torch._grouped_mm` on CPU are not on autocast's lists and compute in fp32. The op then runs in that
    dtype (compute dtype: the hidden states and expert weights cast to it first, as autocast casts them)
    only where every other step of the region is recorded in the dtype the op computes it in; otherwise
    the region runs unfused. Without autocast and without a GEMM cast, compute dtype None; the output dtypes
    follow the casts after the K-sum either way (`_combine_dtypes`)."""
    h_dtype = _dtype(hidden)
    gemms = [n for n in nodes if gu.op_name(n) in ANCHOR_OPS]
    computed = sorted({_dtype(n) for n in gemms}, key=str)
    known, autocast = interp.autocast.at(gemms[0] if gemms else nodes[-1], device_type(hidden))
    cast = computed != [h_dtype]
    if not cast and known and autocast is None:
        return (None,) + _combine_dtypes(nodes, interp.env, describe(None))
    label = describe(autocast) if known else "an autocast entered outside this graph" if cast else \
        "an autocast state that differs between the calls of this body"
    _require(len(computed) == 1, f"the expert GEMMs return {', '.join(map(_dtype_name, computed))} under {label}; "
                                 "the op computes them in one dtype")
    compute = computed[0]
    _require(not (cast and known and autocast not in (None, compute)),
             f"the expert GEMMs return {_dtype_name(compute)} under {label}")
    for gemm in gemms:
        for arg in gemm.all_input_nodes:
            t = gu.tensor_meta(arg)
            _require(t is None or not t.dtype.is_floating_point or t.dtype in (h_dtype, compute),
                     f"{gemm.name} reads {arg.name} in {_dtype_name(t.dtype) if t is not None else '?'} under {label}")
    for name, bias in biases:
        if bias is not None:
            _require(_dtype(bias) == compute,
                     f"the {name} expert bias is {_dtype_name(_dtype(bias))} while the expert GEMMs run in "
                     f"{_dtype_name(compute)} under {label}: eager adds the {_dtype_name(_dtype(bias))} bias to the "
                     f"{_dtype_name(compute)} GEMM output, the op adds it in one compute dtype",
                     f"bias in {_dtype_name(compute)}", _dtype_name(_dtype(bias)))
    env = interp.env
    for node in nodes:
        v = env.get(node)
        dtype = v.dtype if isinstance(v, Halves) else _dtype(node) if isinstance(v, Rows) else None
        if dtype is None or (isinstance(v, Rows) and _input_rows(v.expr)):
            continue
        _require(dtype == compute,
                 f"{node.name} ({gu.op_name(node)}) is {_dtype_name(dtype)} while the expert GEMMs return "
                 f"{_dtype_name(compute)} under {label}: eager runs that step in {_dtype_name(dtype)} (autocast's "
                 f"fp32 policy, or type promotion), the op would run it in {_dtype_name(compute)}",
                 _dtype_name(compute), _dtype_name(dtype))
    for node in nodes:
        v = env.get(node)
        if isinstance(v, Rows) and v.expr[0] == "weighted":
            want = torch.promote_types(compute, _dtype(weights))
            _require(_dtype(node) == want, f"{node.name} weights {_dtype_name(compute)} rows into "
                                           f"{_dtype_name(_dtype(node))} under {label}, not {_dtype_name(want)}")
    return ((compute if cast else None),) + _combine_dtypes(nodes, env, label)


def _combine_dtypes(nodes, env, label):
    """(op output dtype, cast after the op) that reproduce every rounding eager does from its K-sum to the root.

    The region's root absorbs the casts after the K-sum (`x.sum(1).to(bf16).to(fp32)`: each is a Combined of
    its own dtype), and eager rounds at each of them: the sum rounds to its dtype (bf16 under CPU autocast or
    in a bf16 model, fp32 under CUDA autocast's sum policy or in an fp32 model), then every cast rounds again.
    The op sums the K slots in fp32 and rounds once, to its output dtype; one cast may follow it in the graph.
    An fp32 sum is the op's own accumulation, so its first cast is the op's one rounding; what remains must
    be at most the op's output dtype and one cast, or the op would skip a rounding eager does."""
    chain = [env[n].dtype for n in nodes if isinstance(env.get(n), Combined)]
    steps = [d for i, d in enumerate(chain) if i == 0 or d != chain[i - 1]]
    roundings = steps[1:] if steps[0] == torch.float32 and len(steps) > 1 else steps
    _require(len(roundings) <= 2,
             f"the {_dtype_name(steps[0])} K-sum is cast {' -> '.join(map(_dtype_name, steps[1:]))} under {label}: "
             "eager rounds to each narrower dtype on the way, the op rounds its fp32 combine once and casts that "
             "once more, so it would skip a rounding eager does",
             f"at most {'two casts' if steps[0] == torch.float32 else 'one cast'} after the K-sum",
             " -> ".join(map(_dtype_name, steps)))
    _require(roundings[0] in SUPPORTED_DTYPES, f"the combined output is cast to {_dtype_name(roundings[0])} on the way; "
                                               "the op's output dtypes are float32, float16, bfloat16")
    return roundings[0], (roundings[1] if len(roundings) == 2 else None)


_VIEW_OPS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute", "expand", "contiguous",
             "getitem", "detach", "to", "float", "type_as")


def _require_no_writes_to_inputs(nodes: list, inputs: list) -> None:
    """The op call replaces the region at its last node, so its inputs are read later than the region
    read them. Refuse if anything outside the region writes in place to an input (or a tensor it views)
    in between."""
    aliases: set = set()
    stack = [n for n in inputs if n is not None]
    while stack:
        node = stack.pop()
        if node in aliases:
            continue
        aliases.add(node)
        if gu.op_name(node) in _VIEW_OPS and node.args and isinstance(node.args[0], Node):
            stack.append(node.args[0])
    members = set(nodes)
    graph_nodes = list(nodes[0].graph.nodes)
    for node in graph_nodes[graph_nodes.index(nodes[0]):graph_nodes.index(nodes[-1])]:
        if node not in members and gu.is_in_place(node) and node.args and node.args[0] in aliases:
            raise Mismatch(f"{node.name} writes in place to {node.args[0].name}, an input of the experts region, "
                           "while the region runs")


def region_nodes(root: Node, env: dict) -> list:
    """Every node computing part of the region: the MoE-valued ancestors of root, plus the in-place
    writes (setitem, add_) into any of them. Returned in graph order."""
    region: set = set()
    stack = [root]
    while True:
        while stack:
            node = stack.pop()
            if node in region:
                continue
            region.add(node)
            stack.extend(a for a in node.all_input_nodes if a in env)
        writes = [u for n in region for u in n.users if u not in region and u in env
                  and gu.is_in_place(u) and u.args[0] in region]
        if not writes:
            break
        stack.extend(writes)
    return [n for n in root.graph.nodes if n in region]


def find_experts_regions(graph: Graph) -> tuple[list[ExpertsMatch], list[NearMiss]]:
    interp = Interpreter(graph).run()
    interp.autocast = AutocastView(graph)
    env = interp.env
    matches, misses = [], list(interp.failures)
    for node, value in env.items():
        if not isinstance(value, Combined):
            continue
        # the region's root is the last Combined value: one whose users are not combines themselves
        if node.users and all(isinstance(env.get(u), Combined) for u in node.users):
            continue
        try:
            matches.append(check_region(node, value, interp))
        except Mismatch as exc:
            misses.append(NearMiss(node, str(exc), gu.module_path(node), exc.expected, exc.actual))
    taken: set = set()
    accepted = []
    for match in matches:
        if taken.isdisjoint(match.nodes):
            accepted.append(match)
            taken.update(match.nodes)
    return accepted, _relevant_misses(graph, env, misses, taken)


def _relevant_misses(graph, env, misses, taken) -> list[NearMiss]:
    """One near miss per grouped-GEMM/bmm anchor left unrewritten, named after the anchor's module:
    the earliest failure upstream of it inside the same module (the root cause, e.g. a descending
    sort), else the earliest downstream of it. Ordinary model code (attention bmm, say) touches no
    MoE value and yields none."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_node = {}
    for miss in misses:
        by_node.setdefault(miss.node, miss)

    def cone(start, step, keep):
        found, visited, stack = [], set(), list(start)
        while stack:
            n = stack.pop()
            if n in visited or not keep(n):
                continue
            visited.add(n)
            if n in by_node:
                found.append(n)
            stack.extend(step(n))
        return sorted(found, key=order.get)

    def routed(value) -> bool:
        # values only MoE code makes; a flattened [T, K]-shaped tensor alone (a mask, say) is not enough
        return isinstance(value, Rows) and (value.order.kind == "sorted" or value.expr[0] in ("W", "B", "lin", "x"))

    out, seen = [], set()
    for anchor in (n for n in graph.nodes if gu.op_name(n) in ANCHOR_OPS and n not in taken):
        module = gu.module_path(anchor)
        if module in seen:
            continue
        # grouped GEMMs exist for MoE; a bmm (attention, say) is reported only if it reads routed rows
        if gu.op_name(anchor) == "bmm" and not any(routed(env.get(a)) for a in anchor.all_input_nodes):
            continue
        upstream = cone([anchor], lambda n: n.all_input_nodes, lambda n: gu.module_path(n) == module)
        downstream = cone([anchor], lambda n: n.users, lambda n: True)
        candidates = upstream or downstream
        cut = split.ddp_cut_reason(anchor, other_failure=bool(candidates))
        if cut is not None:  # the real cause, before whatever check the missing half then failed
            seen.add(module)
            rejections = [by_node[n].reason for n in sorted(set(upstream) | set(downstream), key=order.get)]
            out.append(NearMiss(anchor, cut, module, rejections=[cut] + rejections))
        elif candidates:
            seen.add(module)
            first = by_node[candidates[0]]
            in_module = [n for n in graph.nodes if gu.module_path(n) == module]
            matched = sum(1 for n in in_module if n in env)
            rejections = [by_node[n].reason for n in sorted(set(upstream) | set(downstream), key=order.get)]
            out.append(NearMiss(anchor, first.reason, module, first.expected, first.actual, matched, rejections))
    return out
