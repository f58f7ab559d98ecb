"""The experts pattern: find routed-expert MLP regions in a Dynamo graph and prove what they compute.

The matcher interprets the graph in program order with the abstract values of ``values.py``. Each op
that consumes an MoE value has one transfer rule, which checks every constant it binds (the divisor
of ``perm // K``, histc's bins/min/max, the chunk dimension, the squeeze dimension, ...) and raises
``Mismatch`` with a reason otherwise. A region is proposed wherever the value ``Combined`` appears
(sum over k of weighted expert outputs in slot order); ``check_region`` then proves the whole
expression is ``sum_k w[t,k] * down_e(gate(up_e(x_t)))`` for parameters of the right shapes and
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
from .values import (Arange, BlankRows, Combined, Counts, ExpertsMatch, Halves, InvPerm, InvPermBlank,
                     Mismatch, NearMiss, Offsets, Order, Perm, Rows, SentinelMask, SlotToken, SortPair, Stacked,
                     WeightT)

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


class _Interpreter:
    def __init__(self, graph: Graph):
        self.graph = graph
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
        if not hasattr(self, "_position"):
            self._position = {n: i for i, n in enumerate(self.graph.nodes)}
        return self._position[a] < self._position[b]

    def _consumes_moe(self, node: Node) -> bool:
        return any(isinstance(a, Node) and a in self.env for a in node.all_input_nodes)

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
                           f"histc(bins=E, min=0, max=E-1)", f"histc(bins={bins}, min={lo}, max={hi})")
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

def _extract_program(expr, is_leaf, leaf, operands: list | None, vectors_allowed: bool = False):
    """Turn a row expression into program JSON: `is_leaf(e)` marks the subtrees `leaf(e)` encodes;
    tensor operands (0-d; 1-d too where `vectors_allowed`) are numbered into the shared `operands`."""

    def walk(e):
        kind = e[0]
        if is_leaf(e):
            return leaf(e)
        if kind == "ew":
            _, name, args, kwargs = e
            return ["call", name, [walk(a) for a in args], {k: walk(v) for k, v in kwargs}]
        if kind == "const":
            value = e[1]
            if not (value is None or isinstance(value, (bool, int, float, str))):
                raise Mismatch(f"constant {value!r} in an expert program is not a number")
            return ["const", value]
        if kind == "dtype":
            return gate_program.dtype_const(e[1])
        if kind == "operand":
            if operands is None:
                raise Mismatch(f"the gate reads the tensor {e[1].name}; only a post program may read vectors")
            if _ndim(e[1]) == 1 and not vectors_allowed:
                raise Mismatch(f"the gate reads the vector {e[1].name}; only a post program may read vectors")
            if e[1] not in operands:
                operands.append(e[1])
            return ["operand", operands.index(e[1])]
        raise Mismatch(f"an expert program reads {kind!r} rows")

    return walk(expr)


def _gate_program(act_expr, operands: list) -> tuple[str, tuple]:
    """(encoded gate program, the up-projection expression it reads)."""
    found = {"up": None, "split": None}

    def is_leaf(e):
        return e[0] in ("lin", "bias", "half")

    def leaf(e):
        if e[0] == "half":
            _, index, split, inner = e
            if inner[0] not in ("lin", "bias"):
                raise Mismatch("the gate halves are not halves of the up projection")
        else:
            index, split, inner = None, "none", e
        if found["up"] is None:
            found["up"], found["split"] = inner, split
        elif found["up"] != inner or found["split"] != split:
            raise Mismatch("the gate combines two different projections or two different splits")
        return ["h"] if index is None else (["gate"] if index == 0 else ["up"])

    expr = _extract_program(act_expr, is_leaf, leaf, operands)
    if found["up"] is None:
        raise Mismatch("the gate does not read the up projection")
    return gate_program.encode(found["split"], expr), found["up"]


def _post_program(rows_expr, operands: list) -> tuple[str | None, tuple]:
    """(encoded post program or None, the down-projection expression); its operands join `operands`."""
    if rows_expr[0] in ("lin", "bias"):
        return None, rows_expr
    found = []

    def leaf(e):
        if found and found[0] != e:
            raise Mismatch("the rows after the down projection mix two projections")
        found[:1] = [e]
        return ["y"]

    expr = _extract_program(rows_expr, lambda e: e[0] in ("lin", "bias"), leaf, operands, vectors_allowed=True)
    if not found:
        raise Mismatch("the weighted rows are not computed from the down projection")
    return gate_program.encode("post", expr), found[0]


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


def check_region(root: Node, value: Combined, interp: "_Interpreter") -> ExpertsMatch:
    """Prove that `value` is sum_k w[t,k] * down_e(gate(up_e(x_t))) over parameters of the right shapes."""
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
    for name, node in (("up", w_up), ("down", w_down)):
        _require(gu.parameter_of(node) is not None, f"the {name} expert weight {node.name} is not a module parameter",
                 f"the experts' {name} weight: an nn.Parameter", f"{node.op} {node.name} (not a parameter)")
        _require(_dtype(node) == h_dtype, f"expert weights are {_dtype_name(_dtype(node))} but hidden states "
                                          f"are {_dtype_name(h_dtype)} (mixed precision is not supported)")
    for name, node in (("up", b_up), ("down", b_down)):
        if node is not None:
            _require(gu.parameter_of(node) is not None, f"the {name} expert bias {node.name} is not a module parameter")
            _require(_dtype(node) == h_dtype, f"the {name} expert bias is {_dtype_name(_dtype(node))}")
    _require(_dtype(weights) is not None and _dtype(weights).is_floating_point, "routing weights are not floating point")
    _require(len(h_shape) == 2 and len(ids_shape) == 2 and len(w_shape) == 2, "hidden, ids and weights must be 2-D")
    tokens, hidden_size = h_shape
    _require(gu.same_int(ids_shape[0], tokens) and gu.same_int(w_shape[0], tokens),
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
    _require_no_writes_to_inputs(nodes, [hidden, ids, weights, w_up, w_down, b_up, b_down] + post_operands)
    anchors = [n for n in nodes if gu.op_name(n) in ANCHOR_OPS]
    spelling = "batched_mm" if any(gu.op_name(n) == "bmm" for n in anchors) else "grouped_mm"
    out_of_range = _out_of_range_mode(interp.id_bounds.get(ids, []), num_experts, spelling)
    for operand in post_operands:
        if _ndim(operand) == 1 and not gu.same_int(_shape(operand)[0], hidden_size):
            raise Mismatch(f"post-projection vector {operand.name} has {_shape(operand)[0]} entries, not "
                           f"H={hidden_size}", f"[{hidden_size}]", list(_shape(operand)))
    spec = ExpertsSpec(up_layout, down_layout, gate, out_dtype, out_of_range, post)
    return ExpertsMatch(root, nodes, hidden, ids, weights, w_up, w_down, b_up, b_down, spec,
                        gu.module_path(root), spelling, anchors, post_operands)


_VIEW_OPS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute", "expand", "contiguous",
             "getitem", "detach", "to", "float", "type_as")


def _is_in_place(node: Node) -> bool:
    name = gu.op_name(node) or ""
    return name == "setitem" or (name.endswith("_") and not name.startswith("_")) or \
        node.kwargs.get("out") is not None


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
        if node not in members and _is_in_place(node) and node.args and node.args[0] in aliases:
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
                  and _is_in_place(u) and u.args[0] in region]
        if not writes:
            break
        stack.extend(writes)
    return [n for n in root.graph.nodes if n in region]


def find_experts_regions(graph: Graph) -> tuple[list[ExpertsMatch], list[NearMiss]]:
    interp = _Interpreter(graph).run()
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
        if candidates:
            seen.add(module)
            first = by_node[candidates[0]]
            in_module = [n for n in graph.nodes if gu.module_path(n) == module]
            matched = sum(1 for n in in_module if n in env)
            rejections = [by_node[n].reason for n in sorted(set(upstream) | set(downstream), key=order.get)]
            out.append(NearMiss(anchor, first.reason, module, first.expected, first.actual, matched, rejections))
    return out
