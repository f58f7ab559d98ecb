"""The experts matcher's interpreter: the abstract value of every node of a Dynamo graph.

Nodes are interpreted in program order with the values of ``values.py``. Each op that consumes an
MoE value has one transfer rule (``_t_<op>``), which checks every constant it binds (the divisor of
``perm // K``, histc's bins/min/max, the chunk dimension, the squeeze dimension, ...) and raises
``Mismatch`` with a reason otherwise. In-place ops update the value of the tensor they write, so
later readers see the write, as in eager.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..kernels import gate_program
from . import graph_utils as gu
from .values import (Arange, BlankRows, Combined, Counts, Halves, InvPerm, InvPermBlank, Mismatch, NearMiss,
                     Offsets, Order, Perm, Rows, SentinelMask, SlotToken, SortPair, Stacked, WeightT)

ANCHOR_OPS = ("grouped_mm", "bmm")
_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_INT_CASTS = ("int", "long", "short")
_INPLACE = {"add_": "add", "mul_": "mul", "sub_": "sub", "div_": "truediv", "clamp_": "clamp"}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ndim(node) -> int | None:
    t = gu.tensor_meta(node)
    return t.dim() if t is not None else None


def _dtype(node):
    t = gu.tensor_meta(node)
    return t.dtype if t is not None else None


def _orders_unify(a: Order, b: Order) -> Order | None:
    """The common order of two row values, or None when their rows do not line up."""
    if a.kind != b.kind or not gu.same_int(a.top_k, b.top_k):
        return None
    if a.kind == "sorted":
        return a if a.sort is b.sort else None
    if a.ids is not None and b.ids is not None and a.ids is not b.ids:
        return None
    return a if a.ids is not None else b


class Interpreter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self._position = {n: i for i, n in enumerate(graph.nodes)}
        self.env: dict[Node, object] = {}
        self.failures: list[NearMiss] = []
        # per expert-id tensor, the bounds the graph compares or clamps ids against, checked against
        # E once the region's weights are known: [("ge", c) | ("gt", c) | ("clamp", lo, hi), ...]
        self.id_bounds: dict[Node, list] = {}

    # -- driver -------------------------------------------------------------------------------
    def run(self):
        for node in self.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = gu.op_name(node)
            try:
                value = self.transfer(node, name)
            except Mismatch as exc:
                self.failures.append(NearMiss(node, f"{node.name} ({name}): {exc}", gu.module_path(node),
                                              exc.expected, exc.actual))
                value = None
            except gu.NotConstant as exc:
                self.failures.append(NearMiss(node, f"{node.name} ({name}): argument {exc.args[0]} is not a "
                                                    "compile-time constant", gu.module_path(node)))
                value = None
            if value is not None:
                self.env[node] = value
        return self

    def val(self, arg):
        return self.env.get(arg) if isinstance(arg, Node) else None

    def _before(self, a: Node, b: Node) -> bool:
        return self._position[a] < self._position[b]

    def _consumes_moe(self, node: Node) -> bool:
        # an arange is an MoE value only as what the inverse permutation is filled with: other ops may
        # read one (local expert ids built from arange(E).repeat(...) under expert parallelism, say)
        return any(isinstance(a, Node) and a in self.env and not isinstance(self.env[a], Arange)
                   for a in node.all_input_nodes)

    # -- transfer rules -----------------------------------------------------------------------
    def transfer(self, node: Node, name: str | None):
        if name is None:
            if self._consumes_moe(node):
                raise Mismatch(f"unknown op {node.target!r}")
            return None
        rule = getattr(self, f"_t_{name}", None)
        if name in gate_program.ELEMENTWISE_OPS or name in _INPLACE or name in _CASTS or name in _INT_CASTS \
                or name == "type_as":
            rule = self._t_elementwise
        if rule is None:
            if self._consumes_moe(node):
                raise Mismatch(f"op {name!r} is not part of the experts pattern")
            return None
        return rule(node, name)

    def _t_reshape(self, node, name):
        src = node.args[0]
        v = self.val(src)
        out = gu.tensor_meta(node)
        if v is None:
            # a [T, K] tensor flattened to the S slots: expert ids or routing weights
            inp = gu.tensor_meta(src)
            if inp is None or out is None or inp.dim() != 2 or out.dim() != 1:
                return None
            order = Order("flat", None, inp.shape[1])
            if not inp.dtype.is_floating_point and inp.dtype != torch.bool:
                return Rows(Order("flat", src, inp.shape[1]), ("eid",), "vec", inp.dtype)
            return Rows(order, ("w", src), "vec", inp.dtype)
        if isinstance(v, Rows) and v.shape == "row" and v.order.kind == "flat" and out is not None and out.dim() == 3:
            if not gu.same_int(out.shape[1], v.order.top_k):
                raise Mismatch(f"view to {tuple(out.shape)} does not put the K={v.order.top_k} slots of a token "
                               "in dimension 1")
            return Stacked(v.expr, v.order.ids, v.order.top_k)
        if isinstance(v, Rows) and v.shape == "row" and out is not None and out.dim() == 2 and \
                gu.same_int(out.shape[1], gu.tensor_meta(src).shape[1]):
            return v  # a no-op reshape of rows
        raise Mismatch("reshape of MoE rows to an unsupported shape")

    _t_view = _t_reshape
    _t_flatten = _t_reshape

    def _t_sort(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, "sort")
        if not (isinstance(v, Rows) and v.expr == ("eid",) and v.order.kind == "flat"):
            raise Mismatch("sorts something other than the flat expert ids")
        descending, dim = gu.constant(b["descending"]), gu.constant(b["dim"])
        if descending is not False or not gu.is_dim(dim, 0, 1):
            raise Mismatch("expert ids must be sorted ascending along their only dimension",
                           "sort(dim=-1 or 0, descending=False)", f"sort(dim={dim}, descending={descending})")
        return SortPair(v.order.ids, v.order.top_k, node)

    def _t_argsort(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        pair = self._t_sort(node, "sort")
        return Perm(pair.ids, pair.top_k, node)

    def _t_getitem(self, node, name):
        base, index = node.args[0], node.args[1]
        bv, iv = self.val(base), self.val(index)
        if bv is None and iv is None:
            return None
        if isinstance(bv, SortPair) and index in (0, 1):
            order = Order("sorted", bv.ids, bv.top_k, bv.sort)
            return Rows(order, ("eid",), "vec", _dtype(node)) if index == 0 else Perm(bv.ids, bv.top_k, bv.sort)
        if isinstance(bv, Halves) and index in (0, 1):
            return Rows(bv.order, ("half", index, "chunk", bv.expr), "row", bv.dtype)
        if bv is None and isinstance(iv, SlotToken):
            t = gu.tensor_meta(base)
            if t is None or t.dim() != 2 or not t.dtype.is_floating_point:
                raise Mismatch("gathers token rows from something that is not a [T, H] hidden-state tensor")
            return Rows(iv.order, ("x", base), "row", t.dtype)
        if isinstance(bv, Rows) and isinstance(iv, Perm) and bv.order.kind == "flat" and bv.shape == "vec":
            if bv.expr[0] != "w":
                raise Mismatch("permutes flat values other than the routing weights")
            if not gu.same_int(bv.order.top_k, iv.top_k):
                raise Mismatch("routing weights and expert ids have different K")
            return Rows(Order("sorted", iv.ids, iv.top_k, iv.sort), bv.expr, "vec", bv.dtype)
        if bv is None and isinstance(iv, Rows) and iv.expr == ("eid",):
            return self._gather_expert_param(base, iv, node)
        if isinstance(bv, Rows) and isinstance(iv, InvPerm):
            if bv.order.kind != "sorted" or bv.order.sort is not iv.sort or bv.shape != "row":
                raise Mismatch("the inverse permutation is applied to rows of another order")
            return Rows(Order("flat", bv.order.ids, bv.order.top_k), bv.expr, "row", bv.dtype)
        if isinstance(bv, Rows) and bv.shape == "row" and iv is None:
            return self._slice_halves(bv, index, node)
        raise Mismatch("indexing of MoE values the experts op does not compute")

    def _gather_expert_param(self, base, ids_rows: Rows, node):
        t = gu.tensor_meta(base)
        if t is None or t.dim() not in (2, 3):
            raise Mismatch("gathers per-expert values from a tensor that is not [E, ...]")
        kind = ("W", base) if t.dim() == 3 else ("B", base)
        return Rows(ids_rows.order, kind, "mat" if t.dim() == 3 else "row", t.dtype)

    def _slice_halves(self, rows: Rows, index, node):
        index = gu.constant(index)
        if not isinstance(index, tuple) or len(index) != 2 or not isinstance(index[1], slice):
            raise Mismatch(f"index {index!r} of expert rows is not a slice of the feature dimension")
        if index[0] is not Ellipsis and index[0] != slice(None):
            raise Mismatch(f"index {index!r} slices the rows themselves")
        width = gu.tensor_meta(node.args[0]).shape[-1]
        sl = index[1]
        parts = {(None, None, 2): (0, "interleave"), (1, None, 2): (1, "interleave")}
        key = (sl.start, sl.stop, sl.step)
        if key in parts:
            half, split = parts[key]
        elif sl.step in (None, 1) and sl.start in (None, 0) and gu.same_int(sl.stop, width // 2):
            half, split = 0, "chunk"
        elif sl.step in (None, 1) and sl.stop is None and gu.same_int(sl.start, width // 2):
            half, split = 1, "chunk"
        else:
            raise Mismatch(f"slice {sl} of the up projection is neither a half nor an interleaved half")
        return Rows(rows.order, ("half", half, split, rows.expr), "row", rows.dtype)

    def _t_floordiv(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        if not isinstance(v, Perm):
            raise Mismatch("integer division of something other than the sort permutation")
        divisor = gu.constant(node.args[1])
        if not gu.same_int(divisor, v.top_k):
            raise Mismatch(f"perm // {divisor}: the divisor must be K={v.top_k}", f"perm // {v.top_k}",
                           f"perm // {divisor}")
        return SlotToken(Order("sorted", v.ids, v.top_k, v.sort))

    def _t_repeat_interleave(self, node, name):
        if self.val(node.args[0]) is not None:
            raise Mismatch("repeat_interleave of MoE values")
        b = gu.bind(node, name)
        t = gu.tensor_meta(node.args[0])
        if t is None or t.dim() != 2 or not t.dtype.is_floating_point:
            return None
        repeats = gu.constant(b["repeats"])
        if not isinstance(repeats, (int, torch.SymInt)) or not gu.is_dim(gu.constant(b["dim"]), 0, 2):
            return None
        return Rows(Order("flat", None, repeats), ("x", node.args[0]), "row", t.dtype)

    def _t_histc(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, name)
        bins, lo, hi = (gu.constant(b[k]) for k in ("bins", "min", "max"))
        if not (isinstance(v, Rows) and v.expr == ("eid",)):
            raise Mismatch("histc of something other than the expert ids")
        if not isinstance(bins, int) or lo != 0 or hi != bins - 1:
            raise Mismatch(f"histc(bins={bins}, min={lo}, max={hi}) does not count experts 0..bins-1",
                           "histc(bins=E, min=0, max=E-1)", f"histc(bins={bins}, min={lo}, max={hi})")
        return Counts(v.order.ids, bins)

    def _t_bincount(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, name)
        if not (isinstance(v, Rows) and v.expr == ("eid",)) or b["weights"] is not None:
            raise Mismatch("bincount of something other than the expert ids")
        minlength = gu.constant(b["minlength"])
        if not isinstance(minlength, int) or minlength <= 0:
            raise Mismatch("bincount without minlength=num_experts")
        return Counts(v.order.ids, minlength)

    def _t_cumsum(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, name)
        if not isinstance(v, Counts) or not gu.is_dim(gu.constant(b["dim"]), 0, 1):
            raise Mismatch("cumsum of something other than the per-expert counts")
        if b.get("dtype") not in (None, torch.int32, torch.int64):
            raise Mismatch(f"cumsum of counts to {b.get('dtype')}")
        return Offsets(v.ids, v.num_experts)

    def _t_transpose(self, node, name):
        src = node.args[0]
        if self.val(src) is not None:
            raise Mismatch("transpose of MoE rows")
        t = gu.tensor_meta(src)
        if t is None or t.dim() != 3:
            return None
        d0, d1 = gu.constant(node.args[1]), gu.constant(node.args[2])
        if {d0 % 3 if isinstance(d0, int) else None, d1 % 3 if isinstance(d1, int) else None} != {1, 2}:
            return None
        return WeightT(src)

    def _t_grouped_mm(self, node, name):
        b = gu.bind(node, name)
        a, w, offs = self.val(b["input"]), self.val(b.get("weight")), self.val(b.get("offs"))
        if a is None and w is None and offs is None:
            return None
        if b.get("bias") is not None or b.get("out_dtype") is not None:
            raise Mismatch("grouped_mm with a fused bias or out_dtype")
        if not (isinstance(a, Rows) and a.shape == "row" and a.order.kind == "sorted"):
            raise Mismatch("the grouped GEMM's input is not expert-sorted token rows")
        if not isinstance(offs, Offsets) or offs.ids is not a.order.ids:
            raise Mismatch("the grouped GEMM's offsets are not the cumulative expert counts of the same ids")
        if isinstance(w, WeightT):
            param, layout = w.param, "oi"
        elif w is None and _ndim(b.get("weight")) == 3:
            param, layout = b["weight"], "io"
        else:
            raise Mismatch("the grouped GEMM's weight is not a 3-D expert weight or its transpose")
        t = gu.tensor_meta(param)
        if not gu.same_int(t.shape[0], offs.num_experts):
            raise Mismatch(f"expert weight has {t.shape[0]} experts, the counts have {offs.num_experts} bins")
        return Rows(a.order, ("lin", self._strip_cast(a.expr, t.dtype), param, layout), "row", _dtype(node))

    @staticmethod
    def _strip_cast(expr, dtype):
        # `x.to(weight.dtype)` before a GEMM; the op applies the same cast itself.
        while expr[0] == "ew" and expr[1] == "to" and expr[2][1] == ("dtype", dtype):
            expr = expr[2][0]
        return expr

    def _t_unsqueeze(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        dim = gu.constant(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
        if isinstance(v, Rows) and v.shape == "row":
            if gu.is_dim(dim, 2, 3):
                return Rows(v.order, v.expr, "col3", v.dtype)
            if gu.is_dim(dim, 1, 3):
                return Rows(v.order, v.expr, "row3", v.dtype)
        if isinstance(v, Rows) and v.shape == "vec" and gu.is_dim(dim, 1, 2):
            return Rows(v.order, v.expr, "vec_col", v.dtype)
        if isinstance(v, SentinelMask) and gu.is_dim(dim, 1, 2):
            return v
        raise Mismatch(f"unsqueeze({dim}) of MoE values")

    def _t_bmm(self, node, name):
        lhs, rhs = self.val(node.args[0]), self.val(node.args[1])
        if lhs is None and rhs is None:
            return None
        if isinstance(lhs, Rows) and lhs.shape == "mat" and isinstance(rhs, Rows) and rhs.shape == "col3":
            order, param, x, layout, shape = _orders_unify(lhs.order, rhs.order), lhs.expr, rhs, "oi", "bmm_col"
        elif isinstance(lhs, Rows) and lhs.shape == "row3" and isinstance(rhs, Rows) and rhs.shape == "mat":
            order, param, x, layout, shape = _orders_unify(lhs.order, rhs.order), rhs.expr, lhs, "io", "bmm_row"
        else:
            raise Mismatch("bmm operands are not per-slot expert weights and per-slot rows")
        if order is None or param[0] != "W":
            raise Mismatch("bmm of expert weights and rows gathered in different orders")
        dtype = gu.tensor_meta(param[1]).dtype
        return Rows(order, ("lin", self._strip_cast(x.expr, dtype), param[1], layout), shape, _dtype(node))

    def _t_squeeze(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        dim = gu.constant(gu.bind(node, name)["dim"])
        if isinstance(v, Rows) and ((v.shape == "bmm_col" and gu.is_dim(dim, 2, 3))
                                    or (v.shape == "bmm_row" and gu.is_dim(dim, 1, 3))):
            return Rows(v.order, v.expr, "row", v.dtype)
        raise Mismatch(f"squeeze({dim}) of MoE values")

    def _t_chunk(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, name)
        if not (isinstance(v, Rows) and v.shape == "row"):
            raise Mismatch("chunk of MoE values that are not rows")
        if gu.constant(b["chunks"]) != 2 or not gu.is_dim(gu.constant(b["dim"]), 1, 2):
            raise Mismatch(f"chunk({b['chunks']}, dim={b['dim']}): the gate split must be 2 halves of the last dim",
                           "chunk(2, dim=-1)", f"chunk({b['chunks']}, dim={b['dim']})")
        if gu.tensor_meta(node.args[0]).shape[-1] % 2 != 0:
            raise Mismatch("odd up-projection width cannot be split into gate and up")
        return Halves(v.order, v.expr, v.dtype)

    def _t_elementwise(self, node, name):
        canonical = _INPLACE.get(name, name)
        args = list(node.args)
        kwargs = dict(node.kwargs)
        if name in _CASTS:
            canonical, args, kwargs = "to", [args[0], _CASTS[name]], {}
        elif name in _INT_CASTS:
            v = self.val(args[0])
            if (isinstance(v, Rows) and v.expr == ("eid",)) or isinstance(v, (Counts, Offsets)):
                return v  # expert ids cast for histc, counts or offsets cast to an integer type
            if v is not None:
                raise Mismatch(f"{name}() of MoE values")
            return None
        elif name == "type_as":
            other = gu.tensor_meta(args[1]) if isinstance(args[1], Node) else None
            if other is None:
                if self._consumes_moe(node):
                    raise Mismatch("type_as of something that is not a tensor")
                return None
            canonical, args, kwargs = "to", [args[0], other.dtype], {}
        elif name == "to":
            b = gu.bind(node, "to")
            dtypes = [gu.constant(a) for a in b["args"] if not isinstance(a, Node) or gu.tensor_meta(a) is None]
            dtypes += [gu.constant(kwargs[k]) for k in ("dtype",) if k in kwargs]
            extra = set(kwargs) - {"dtype", "copy", "non_blocking"}
            if len(dtypes) != 1 or not isinstance(dtypes[0], torch.dtype) or extra:
                if self._consumes_moe(node):
                    raise Mismatch("to() with arguments other than one dtype")
                return None
            args, kwargs = [args[0], dtypes[0]], {}
        vals = [self.val(a) for a in args]
        if not any(v is not None for v in vals):
            return None
        first = vals[0]
        if canonical == "clamp" and isinstance(first, Rows) and first.expr == ("eid",):
            b = gu.bind(node, name)
            bounds = (gu.constant(b["min"]), gu.constant(b["max"]))
            self.id_bounds.setdefault(first.order.ids, []).append(("clamp",) + bounds)
            return first
        if canonical == "to" and isinstance(first, Rows) and first.expr == ("eid",):
            return first
        if canonical == "to" and isinstance(first, (Counts, Offsets)):
            if args[1] not in (torch.int32, torch.int64):
                raise Mismatch(f"expert counts cast to {args[1]}")
            return first
        if canonical == "to" and isinstance(first, Combined):
            return Combined(first.expr, first.ids, first.top_k, args[1])
        if canonical == "mul":
            weighted = self._weighting(vals, node)
            if weighted is not None:
                return weighted
        if canonical == "add" and len(vals) == 2 and isinstance(vals[1], Rows) and vals[1].expr[0] == "B":
            result = self._bias_add(vals[0], vals[1], node)
            if name in _INPLACE:
                # Later readers of the projection see the bias; earlier ones (views taken before the
                # write would see it too in eager) would be misread, so refuse them.
                earlier = [u for u in args[0].users if u is not node and self._before(u, node)]
                if earlier:
                    raise Mismatch(f"{earlier[0].name} reads {args[0].name} before its in-place bias add")
                self.env[args[0]] = result
            return result
        if name in _INPLACE:
            raise Mismatch(f"in-place {name} on MoE values (only a bias add_ is supported)")
        if canonical not in gate_program.ELEMENTWISE_OPS:
            raise Mismatch(f"op {name!r} on expert rows is not element-wise")
        _fn, allowed = gate_program.ELEMENTWISE_OPS[canonical]
        if kwargs.get("inplace"):
            raise Mismatch(f"in-place {canonical} on expert rows")
        if isinstance(first, Stacked):
            raise Mismatch(f"{canonical} of the [T, K, H] slot values: the op's combine is a sum over K")
        if canonical in gate_program.ROW_REDUCTIONS:
            b = {"dim": args[1] if len(args) > 1 else kwargs.get("dim"), "keepdim": kwargs.get("keepdim", False)}
            if len(args) > 2 or not gu.is_dim(gu.constant(b["dim"]), 1, 2) or gu.constant(b["keepdim"]) is not True:
                raise Mismatch(f"{canonical} over expert rows must reduce the last dim with keepdim=True")
        kwargs.pop("inplace", None)
        if set(kwargs) - set(allowed):
            raise Mismatch(f"{canonical} with unsupported keywords {sorted(set(kwargs) - set(allowed))}")
        order, out_args = None, []
        for a, v in zip(args, vals):
            if v is None:
                scalar = self._scalar_expr(a) if isinstance(a, Node) else None
                if scalar is not None:
                    out_args.append(scalar)
                    continue
                if isinstance(a, Node) and gu.tensor_meta(a) is not None:
                    t = gu.tensor_meta(a)
                    if t.dim() <= 1 and t.dtype.is_floating_point:
                        # a scalar lifted to a graph input, or a vector broadcast over rows (a norm weight)
                        out_args.append(("operand", a))
                        continue
                    raise Mismatch(f"{canonical} mixes expert rows with the tensor {a.name} {tuple(t.shape)}")
                c = gu.constant(a)
                if isinstance(c, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    raise Mismatch(f"{canonical} with a symbolic scalar")
                out_args.append(("dtype", c) if isinstance(c, torch.dtype) else ("const", c))
                continue
            if not (isinstance(v, Rows) and v.shape == "row"):
                raise Mismatch(f"{canonical} of MoE values that are not expert rows")
            order = v.order if order is None else _orders_unify(order, v.order)
            if order is None:
                raise Mismatch(f"{canonical} of expert rows in different orders")
            out_args.append(v.expr)
        out_kwargs = []
        for k, a in sorted(kwargs.items()):
            if isinstance(a, Node):
                scalar = self._scalar_expr(a)
                if scalar is None:
                    raise Mismatch(f"{canonical} keyword {k} is a tensor or symbol, not a scalar of the model")
                out_kwargs.append((k, scalar))
                continue
            out_kwargs.append((k, ("const", a)))
        return Rows(order, ("ew", canonical, tuple(out_args), tuple(out_kwargs)), "row", _dtype(node))

    def _scalar_expr(self, arg, depth=0):
        """A scalar argument as a program expression, when Dynamo lifted a model constant (a float
        config attribute under dynamic=True) to a graph input: ("operand", x) for a 0-d tensor x or
        `x.item()`, and arithmetic over those (`-limit`); None for anything else."""
        if not isinstance(arg, Node):
            return ("const", arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None
        if self.val(arg) is not None or depth > 8:
            return None
        base = arg.args[0] if arg.op == "call_method" and arg.target == "item" and arg.args else arg
        t = gu.tensor_meta(base) if isinstance(base, Node) else None
        if t is not None:
            return ("operand", base) if t.dim() == 0 and t.dtype.is_floating_point and self.val(base) is None else None
        name = gu.op_name(arg)
        if isinstance(gu.example(arg), torch.SymFloat) and name in ("neg", "add", "sub", "mul", "truediv"):
            parts = [self._scalar_expr(a, depth + 1) for a in arg.args]
            if all(p is not None for p in parts) and not arg.kwargs:
                return ("ew", name, tuple(parts), ())
        return None

    def _weighting(self, vals, node):
        pairs = [(vals[0], vals[1]), (vals[1], vals[0])] if len(vals) == 2 else []
        for rows, weights in pairs:
            if isinstance(rows, Rows) and rows.shape == "row" and isinstance(weights, Rows) \
                    and weights.shape == "vec_col" and weights.expr[0] == "w":
                order = _orders_unify(rows.order, weights.order)
                if order is None:
                    raise Mismatch("routing weights multiplied onto expert rows of another order")
                return Rows(order, ("weighted", rows.expr, weights.expr[1]), "row", _dtype(node))
        return None

    def _bias_add(self, rows, bias, node):
        if not (isinstance(rows, Rows) and rows.shape == "row" and rows.expr[0] == "lin"):
            raise Mismatch("a per-expert bias is added to something other than a projection")
        order = _orders_unify(rows.order, bias.order)
        if order is None:
            raise Mismatch("bias rows gathered in another order than the projection rows")
        return Rows(order, ("bias", rows.expr, bias.expr[1]), "row", _dtype(node))

    def _t_empty_like(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        if isinstance(v, Perm):
            return InvPermBlank(v.sort)
        if isinstance(v, Rows) and v.shape == "row":
            return BlankRows()
        raise Mismatch("empty_like of MoE values")

    _t_zeros_like = _t_empty_like

    def _t_arange(self, node, name):
        args = [gu.constant(a) for a in node.args]
        if len(args) == 1 or (len(args) == 2 and args[0] == 0):
            return Arange(args[-1]) if node.kwargs.get("dtype") in (None, torch.int64) else None
        return None

    def _t_setitem(self, node, name):
        target, index, value = node.args
        tv, iv, vv = self.val(target), self.val(index), self.val(value)
        if tv is None and iv is None and vv is None:
            return None
        if isinstance(tv, InvPermBlank) and isinstance(iv, Perm) and iv.sort is tv.sort and isinstance(vv, Arange):
            if not gu.same_int(vv.end, gu.tensor_meta(index).shape[0]):
                raise Mismatch("inverse permutation built from an arange of the wrong length")
            self.env[target] = InvPerm(tv.sort)
            return InvPerm(tv.sort)
        if isinstance(tv, BlankRows) and isinstance(iv, Perm) and isinstance(vv, Rows) and \
                vv.order.kind == "sorted" and vv.order.sort is iv.sort and vv.shape == "row":
            rows = Rows(Order("flat", vv.order.ids, vv.order.top_k), vv.expr, "row", vv.dtype)
            self.env[target] = rows
            return rows
        raise Mismatch("an assignment into MoE values the experts op does not compute")

    def _t_ge(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        if not (isinstance(v, Rows) and v.expr == ("eid",)) or self.val(node.args[1]) is not None:
            raise Mismatch(f"comparison ({name}) of MoE values other than expert ids against a constant")
        bound = gu.constant(node.args[1])
        if not isinstance(bound, int):
            raise Mismatch(f"expert ids compared against {bound!r}")
        self.id_bounds.setdefault(v.order.ids, []).append((name, bound))
        return SentinelMask(v.order)

    _t_gt = _t_ge

    def _t_masked_fill(self, node, name):
        b = gu.bind(node, name)
        rows, mask = self.val(b["input"]), self.val(b.get("mask"))
        if rows is None and mask is None:
            return None
        if not (isinstance(rows, Rows) and rows.shape == "row" and isinstance(mask, SentinelMask)):
            raise Mismatch("masked_fill of MoE values with a mask other than the expert-parallel sentinel mask")
        if _orders_unify(rows.order, mask.order) is None:
            raise Mismatch("sentinel mask and rows are in different orders")
        if gu.constant(b.get("value")) != 0:
            raise Mismatch("sentinel rows are filled with a value other than 0")
        # Identity on every routed row; the op drops sentinel slots itself (ExpertsSpec.out_of_range).
        return rows

    _t_masked_fill_ = _t_masked_fill

    def _t_sum(self, node, name):
        v = self.val(node.args[0])
        if v is None:
            return None
        b = gu.bind(node, name)
        if not isinstance(v, Stacked):
            raise Mismatch("a sum over MoE values other than the sum over the K slots of each token")
        if not gu.is_dim(gu.constant(b["dim"]), 1, 3) or gu.constant(b["keepdim"]) or b.get("dtype") is not None:
            raise Mismatch(f"sum(dim={b['dim']}, keepdim={b['keepdim']}): the combine sums the K slots (dim 1)",
                           "sum(dim=1)", f"sum(dim={b['dim']}, keepdim={b['keepdim']}, dtype={b.get('dtype')})")
        return Combined(v.expr, v.ids, v.top_k, _dtype(node))


# -- region proof ---------------------------------------------------------------------------------

