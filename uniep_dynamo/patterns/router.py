"""The router pattern: find router regions (linear -> scores -> top-k -> routing weights) and prove them.

Each node downstream of a ``linear`` of 2-D input and weight (a parameter, or a weight computed in the forward,
as PEFT's LoRA on the router's weight computes it) gets a symbolic term (a tuple)
when it is a step of a router; every constant a step binds (the softmax dim, top-k's dim and
`largest`, the keepdim of the renormalizing sum, the group view's sizes, the -inf fill, ...) is
checked by its rule. A top-k over a term then proposes a region; ``_classify`` reads the expression of
its ids and of the routing weights into a RouterSpec, or says why not. The region is rewritten only if
no intermediate value escapes it (the logits may: HF returns them for the load-balancing loss).

Terms:
    ("logits", linear, cast32)        the linear's output (cast32: its inputs were cast to fp32)
    ("f32", t)                        t.float() / t.to(float32) / t.type(float32)
    ("softmax", node, t) ("sigmoid", node, t)
    ("biased", node, t, bias)         t + a [E] vector (the score-correction bias)
    ("topk", node, t, k)  ("topv", topk) ("topi", topk)
    ("grouped", t, G)  ("gtop2", t, G)  ("gscore", t, G)  ("gidx", t, G, tg)  ("gzeros", t, G)
    ("gmask", t, G, tg)  ("gmask3", t, G, tg)  ("gexp", t, G, tg)  ("emask", t, G, tg)  ("nmask", t, G, tg)
    ("masked", t, G, tg)              t.masked_fill(~expert mask, -inf)
    ("gather", s, topk)               s.gather(1, ids)
    ("rowsum", w, eps)                w.sum(-1, keepdim=True) (+ eps)
    ("renorm", w, eps)  ("scale", w, c)  ("cast", w, dtype)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from ..spec import RouterSpec
from . import graph_utils as gu
from .autocast import AutocastView, describe, device_type, plain_dtype
from .values import Mismatch, NearMiss

_F32_CASTS = ("float", "to", "type")


@dataclass
class RouterMatch:
    """One router region proven equal to torch.ops.uniep.moe_router."""
    logits: Node  # the linear: its users outside the region read the op's logits
    weights: Node  # the routing weights node
    ids: Node  # the top-k ids node
    nodes: list  # the region, in graph order (logits included)
    hidden: Node
    weight: Node
    bias: Node | None
    score_bias: Node | None
    spec: RouterSpec
    module: str
    kept: list = field(default_factory=list)  # fp32 casts of the logits read outside: moved after the op
    # under autocast, the dtype autocast casts the linear's input and weight to (None: no cast); the op reads
    # them cast to it, as eager's linear does
    compute_dtype: torch.dtype | None = None

    @property
    def spelling(self) -> str:
        return self.spec.mode


def _dtype(node):
    t = gu.tensor_meta(node)
    return t.dtype if t is not None else None


def _shape(node):
    t = gu.tensor_meta(node)
    return tuple(t.shape) if t is not None else None


def _ndim(node):
    t = gu.tensor_meta(node)
    return t.dim() if t is not None else None


def _last_dim(node, dim) -> bool:
    n = _ndim(node)
    return n is not None and gu.is_dim(gu.constant(dim), n - 1, n)


def _cast_target(node, name):
    """The dtype a cast node converts to, or None if it is not a plain dtype cast."""
    if name == "float":
        return torch.float32 if len(node.args) == 1 and not node.kwargs else None
    b = gu.bind(node, name)
    if name == "type":
        dtype = gu.constant(b.get("dtype"))
    else:
        args = [a for a in b.get("args", ()) if not isinstance(a, Node)]
        extra = set(node.kwargs) - {"dtype"}
        dtype = gu.constant(node.kwargs["dtype"]) if "dtype" in node.kwargs else (args[0] if len(args) == 1 else None)
        if extra or len(b.get("args", ())) > 1 or any(isinstance(a, Node) for a in b.get("args", ())):
            return None
    return dtype if isinstance(dtype, torch.dtype) else None


class RouterInterp:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.env: dict[Node, tuple] = {}
        self.failures: dict[Node, str] = {}

    def run(self):
        for node in self.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = gu.op_name(node)
            rule = getattr(self, f"_r_{name}", None) if name else None
            try:
                if rule is not None:
                    term = rule(node)
                elif any(a in self.env for a in node.all_input_nodes):
                    raise Mismatch(f"op {name or node.target!r} is not part of a router")
                else:
                    term = None
            except (Mismatch, gu.NotConstant) as exc:
                self.failures[node] = f"{node.name} ({name}): {exc}"
                term = None
            if term is not None:
                self.env[node] = term
        return self

    def t(self, arg):
        return self.env.get(arg) if isinstance(arg, Node) else None

    # -- the linear ---------------------------------------------------------------------------
    @staticmethod
    def _strip_f32(node):
        name = gu.op_name(node) if isinstance(node, Node) else None
        if name in _F32_CASTS and _cast_target(node, name) == torch.float32:
            return node.args[0], True
        return node, False

    def _r_linear(self, node):
        b = gu.bind(node, "linear")
        b.setdefault("weight", node.args[1] if len(node.args) > 1 else None)
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        x, cast_x = self._strip_f32(b["input"])
        w, cast_w = self._strip_f32(b["weight"])
        if _ndim(w) != 2 or _ndim(x) != 2:
            return None
        if bias is not None and _ndim(bias) != 1:
            return None
        return ("logits", node, x, w, bias, cast_x or cast_w)

    # -- element-wise steps -------------------------------------------------------------------
    def _cast(self, node, name):
        t = self.t(node.args[0])
        if t is None:
            return None
        dtype = _cast_target(node, name)
        if dtype is None:
            raise Mismatch(f"{name}() with arguments other than one dtype")
        if dtype == torch.float32 and t[0] == "logits":
            return ("f32", t)
        if dtype == _dtype(node.args[0]):
            return t  # a no-op cast
        return ("cast", t, dtype)

    def _r_float(self, node):
        return self._cast(node, "float")

    def _r_to(self, node):
        return self._cast(node, "to")

    def _r_type(self, node):
        return self._cast(node, "type")

    def _r_type_as(self, node):
        t = self.t(node.args[0])
        other = node.args[1] if len(node.args) > 1 else None
        if t is None and self.t(other) is None:
            return None
        if t is None or self.t(other) is not None or _dtype(other) is None or node.kwargs:
            raise Mismatch("type_as in the router other than a cast to another tensor's dtype")
        dtype = _dtype(other)
        if dtype == torch.float32 and t[0] == "logits":
            return ("f32", t)
        return t if dtype == _dtype(node.args[0]) else ("cast", t, dtype)

    def _r_softmax(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not _last_dim(node.args[0], dim):
            raise Mismatch(f"softmax over dim {dim}, not the last")
        # the dtype sits at a different position in F.softmax, torch.softmax and Tensor.softmax
        dtype = node.kwargs.get("dtype", next((a for a in node.args[2:] if isinstance(a, torch.dtype)), None))
        if dtype is not None and gu.constant(dtype) != _dtype(node.args[0]):
            if gu.constant(dtype) != torch.float32:
                raise Mismatch(f"softmax to {dtype}")
            t = ("f32", t)  # computed on an fp32 upcast of its input
        return ("softmax", node, t)

    def _r_sigmoid(self, node):
        t = self.t(node.args[0])
        return None if t is None else ("sigmoid", node, t)

    def _r_add(self, node):
        a, b = node.args[0], node.args[1]
        ta, tb = self.t(a), self.t(b)
        if ta is None and tb is None:
            return None
        if ta is not None and tb is None and ta[0] == "sigmoid" and isinstance(b, Node) and _ndim(b) == 1:
            return ("biased", node, ta, b)
        if ta is not None and ta[0] == "rowsum" and ta[2] == 0.0 and tb is None and not isinstance(b, Node) \
                and isinstance(b, float) and b >= 0:
            return ("rowsum", ta[1], b)
        raise Mismatch("an addition in the router other than the score-correction bias or a renorm epsilon")

    def _r_view(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        shape = gu.constant(gu.bind(node, "view")["shape"])
        src = _shape(node.args[0])
        if t[0] == "gexp":
            if len(shape) == 2 and shape[0] == -1 and gu.same_int(shape[1], src[1] * src[2]):
                return ("emask",) + t[1:]
            raise Mismatch(f"group mask reshaped to {shape}")
        if len(shape) == 3 and shape[0] == -1 and len(src) == 2 and isinstance(shape[1], int) and \
                gu.same_int(shape[1] * shape[2], src[1]):
            return ("grouped", t, shape[1])
        raise Mismatch(f"router scores viewed as {shape}")

    _r_reshape = _r_view

    def _r_topk(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        b = dict(zip(("input", "k", "dim", "largest", "sorted"), node.args))
        b.update(node.kwargs)
        k, dim = gu.constant(b.get("k")), gu.constant(b.get("dim", -1))
        if gu.constant(b.get("largest", True)) is not True:
            raise Mismatch("top-k of the smallest scores", "largest=True", "largest=False")
        if not _last_dim(node.args[0], dim):
            raise Mismatch(f"top-k over dim {dim}, not the experts", "dim=-1", f"dim={dim}")
        if not isinstance(k, int):
            raise Mismatch(f"top-k with k={k!r}: a compile-time int is needed")
        if t[0] == "grouped":
            if k != 2:
                raise Mismatch(f"group score from the top {k} of each group; the pattern knows the top-2 sum")
            return ("gtopk", t[1], t[2])
        if t[0] == "gscore":
            return ("gtopk_groups", t[1], t[2], k)
        return ("topk", node, t, k)

    def _r_getitem(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        index = node.args[1]
        if t[0] == "topk" and index in (0, 1):
            return ("topv", t) if index == 0 else ("topi", t)
        if t[0] == "gtopk" and index == 0:
            return ("gtop2", t[1], t[2])
        if t[0] == "gtopk_groups" and index == 1:
            return ("gidx",) + t[1:]
        raise Mismatch(f"index {index!r} of a router value")

    def _r_sum(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        b = gu.bind(node, "sum")
        dim, keepdim = gu.constant(b["dim"]), gu.constant(b["keepdim"])
        if b.get("dtype") is not None or not _last_dim(node.args[0], dim):
            raise Mismatch(f"sum(dim={dim}) in the router is not over the last dim")
        if t[0] == "gtop2" and not keepdim:
            return ("gscore", t[1], t[2])
        if keepdim is True and _ndim(node.args[0]) == 2:
            return ("rowsum", t, 0.0)
        raise Mismatch(f"sum(dim={dim}, keepdim={keepdim}) of router weights")

    def _r_zeros_like(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        if t[0] == "gscore" and not node.kwargs:
            return ("gzeros", t[1], t[2])
        raise Mismatch("zeros_like of a router value other than the group scores")

    def _r_scatter_(self, node):
        target, dim, index, value = (list(node.args) + [None] * 4)[:4]
        tt, ti = self.t(target), self.t(index)
        if tt is None and ti is None:
            return None
        if tt is not None and tt[0] == "gzeros" and ti is not None and ti[0] == "gidx" and ti[1] is tt[1] and \
                gu.constant(dim) in (1, -1) and gu.constant(value) == 1 and not node.kwargs:
            term = ("gmask", tt[1], tt[2], ti[3])
            self.env[target] = term  # later readers of the zeros see the scattered ones
            return term
        raise Mismatch("a scatter in the router other than marking the chosen groups")

    def _r_unsqueeze(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        if t[0] == "gmask" and gu.constant(node.args[1] if len(node.args) > 1 else node.kwargs["dim"]) in (-1, 2):
            return ("gmask3",) + t[1:]
        raise Mismatch("unsqueeze of a router value other than the group mask")

    def _r_expand(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        sizes = gu.constant(gu.bind(node, "view")["shape"])
        src = _shape(node.args[0])
        if t[0] == "gmask3" and len(sizes) == 3 and sizes[0] == -1 and gu.same_int(sizes[1], t[2]) and \
                gu.same_int(sizes[1], src[1]):
            return ("gexp", t[1], t[2], t[3], sizes[2])
        raise Mismatch(f"expand{sizes} of a router value")

    def _r_bool(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        if t[0] == "emask":
            return t
        raise Mismatch("bool() of a router value other than the expert mask")

    def _r_invert(self, node):
        t = self.t(node.args[0])
        if t is None:
            return None
        if t[0] == "emask" and _dtype(node.args[0]) == torch.bool:
            return ("nmask",) + t[1:]
        raise Mismatch("~ of a router value other than the expert mask")

    _r_bitwise_not = _r_invert

    def _r_masked_fill(self, node):
        b = gu.bind(node, "masked_fill")
        t, m = self.t(b["input"]), self.t(b.get("mask"))
        if t is None and m is None:
            return None
        value = gu.constant(b.get("value"))
        if m is not None and m[0] == "nmask" and t is m[1] and value == float("-inf"):
            return ("masked", t, m[2], m[3], m[4])
        raise Mismatch("masked_fill in the router other than -inf outside the chosen groups")

    def _r_gather(self, node):
        b = dict(zip(("input", "dim", "index"), node.args))
        b.update(node.kwargs)
        t, ti = self.t(b["input"]), self.t(b.get("index"))
        if t is None and ti is None:
            return None
        if ti is not None and ti[0] == "topi" and t is not None and gu.constant(b.get("dim")) in (1, -1):
            return ("gather", t, ti[1])
        raise Mismatch("a gather in the router other than the scores at the top-k ids")

    def _r_truediv(self, node):
        t, d = self.t(node.args[0]), self.t(node.args[1])
        if t is None and d is None:
            return None
        if d is not None and d[0] == "rowsum" and d[1] is t:
            if node.target is not None and gu.op_name(node) == "div_":
                self.env[node.args[0]] = ("renorm", t, d[2])
            return ("renorm", t, d[2])
        raise Mismatch("a division in the router other than renormalizing the top-k weights by their sum")

    _r_div_ = _r_truediv

    def _r_mul(self, node):
        a, c = node.args[0], node.args[1]
        t = self.t(a)
        if t is None and self.t(c) is not None:
            a, c, t = c, a, self.t(c)
        if t is None:
            return None
        if not isinstance(c, Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
            return ("scale", t, float(c))
        raise Mismatch("a product in the router other than scaling the weights by a constant")

    _r_mul_ = _r_mul


# -- classification -----------------------------------------------------------------------------
def _require(cond, message):
    if not cond:
        raise Mismatch(message)


def _unwrap_logits(t):
    """(logits term, scores in fp32) of a term that is the logits, possibly cast to fp32."""
    if t[0] == "f32" and t[1][0] == "logits":
        return t[1], True
    if t[0] == "logits":
        return t, False
    return None, False


def _classify_weights(w, topk):
    """(base, renorm eps or None, scale, cast dtype or None) of a routing-weights term, steps in the
    order base -> renorm -> scale -> cast."""
    cast = None
    if w[0] == "cast":
        w, cast = w[1], w[2]
    scale = 1.0
    if w[0] == "scale":
        w, scale = w[1], w[2]
    eps = None
    if w[0] == "renorm":
        w, eps = w[1], w[2]
    return w, eps, scale, cast


def classify(weights_term, ids_term) -> tuple:
    """(RouterSpec fields, logits term, score bias node) of a (weights, ids) pair, or Mismatch."""
    topk = ids_term[1]
    _, _topk_node, choice, k = topk
    base, eps, scale, cast = _classify_weights(weights_term, topk)
    fields: dict = {"top_k": k, "renorm": eps is not None, "renorm_eps": eps or 0.0, "scale": scale}
    score_bias = None
    if choice[0] == "softmax":
        logits, fp32 = _unwrap_logits(choice[2])
        _require(logits is not None, "the softmax is not over the router logits")
        ok = base == ("topv", topk) or (base[0] == "gather" and base[1] is choice and base[2] is topk)
        _require(ok, "the routing weights are not the top-k probabilities")
        fields.update(mode="softmax_topk", score_fp32=fp32)
    elif choice[0] in ("sigmoid", "biased", "masked"):
        groups = (1, 1)
        if choice[0] == "masked":
            _, inner, n_group, topk_group, size = choice
            groups = (n_group, topk_group)
            fields["group_size"] = size
            choice = inner
        if choice[0] == "biased":
            score_bias = choice[3]
            sig = choice[2]
        else:
            sig = choice
        _require(sig[0] == "sigmoid", "the top-k choice is not built from sigmoid scores")
        logits, fp32 = _unwrap_logits(sig[2])
        _require(logits is not None, "the sigmoid is not over the router logits")
        ok = (base[0] == "gather" and base[1] is sig and base[2] is topk) or \
             (base == ("topv", topk) and score_bias is None and groups == (1, 1))
        _require(ok, "the routing weights are not the sigmoid scores at the chosen experts")
        fields.update(mode="sigmoid_topk", score_fp32=fp32, n_group=groups[0], topk_group=groups[1],
                      has_score_bias=score_bias is not None)
    else:
        logits, fp32 = _unwrap_logits(choice)
        _require(logits is not None, "the top-k is not over router scores or logits")
        _require(base[0] == "softmax" and base[2] == ("topv", topk) or
                 (base[0] == "softmax" and base[2] == ("f32", ("topv", topk))),
                 "the routing weights are not a softmax of the top-k logits")
        fields.update(mode="topk_softmax", score_fp32=fp32 or base[2][0] == "f32")
    return fields, logits, score_bias, cast


def _region(outputs, env, logits_node, inputs):
    """The router terms the outputs are computed from, back to the linear, plus the in-place writes
    into them (the group mask's scatter_, a renorm's /=) and what those writes read."""
    region, stack = set(), list(outputs)
    while True:
        while stack:
            node = stack.pop()
            if node in region or node not in env:
                continue
            region.add(node)
            if node is not logits_node:
                stack.extend(node.all_input_nodes)
        stack = [user for node in region for user in node.users
                 if user not in region and user in env and gu.op_name(user) in ("scatter_", "div_", "mul_")
                 and user.args[0] is node]
        if not stack:
            break
    for arg in logits_node.all_input_nodes:  # fp32 casts of hidden or weight that only the linear reads
        if arg not in inputs and gu.op_name(arg) in _F32_CASTS and all(u is logits_node for u in arg.users):
            region.add(arg)
    return region


def find_router_regions(graph: Graph) -> tuple[list[RouterMatch], list[NearMiss]]:
    interp = RouterInterp(graph).run()
    env = interp.env
    autocast = AutocastView(graph)
    matches, misses = [], []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for topk_node, term in [(n, t) for n, t in env.items() if t[0] == "topk"]:
        ids_nodes = [u for u in topk_node.users if env.get(u, (None,))[0] == "topi"]
        # the routing weights: the last node of the weights chain of this top-k
        def weights_of(t):
            try:
                base = _classify_weights(t, term)[0]
            except (IndexError, TypeError):
                return False
            if base == ("topv", term):
                return True
            if base[0] == "gather" and base[2] is term:
                return True
            return base[0] == "softmax" and base[2] in (("topv", term), ("f32", ("topv", term)))
        candidates = [n for n, t in env.items() if n is not topk_node and weights_of(t)]
        ends = [n for n in candidates if not any(u in candidates for u in n.users)]
        module = gu.module_path(topk_node)
        if not ends:
            continue  # the top-k values make no routing weights (a top-k of some projection's indices)
        try:
            _require(len(ids_nodes) == 1, "the top-k ids are read more than once or not at all")
            _require(len(ends) == 1, "the top-k values make more than one routing-weights value")
            ids_node, weights_node = ids_nodes[0], ends[0]
            weights_term = env[weights_node]
            # an in-place renorm: the weights are the tensor written, as later readers see it
            fields, logits, score_bias, cast = classify(weights_term, env[ids_node])
            linear, x, w, bias, cast32 = logits[1], logits[2], logits[3], logits[4], logits[5]
            compute_dtype, label = _autocast_cast(linear, x, w, cast32, autocast)
            spec = _build_spec(fields, linear, x, w, bias, score_bias, cast32, weights_node, cast, compute_dtype)
            region = _region([ids_node, weights_node], env, linear, (x, w, bias))
            if label is not None:
                _require_plain_dtypes(region, linear, label, order)
            _require(not any(n.op == "call_function" and gu.op_name(n) == "topk" and env.get(n, (None,))[0] == "topk"
                             and n is not topk_node for n in region), "two top-k selections in one router")
            # An fp32 cast of the logits that is also read outside (HF returns router_logits.float()) stays
            # in the graph, moved after the op, reading the op's logits.
            kept = [n for n in region if env.get(n, ("",))[0] == "f32" and env[n][1][1] is linear
                    and any(u not in region for u in n.users)]
            region -= set(kept)
            nodes = sorted(region, key=order.get)
            for node in nodes:
                if node in (linear, ids_node, weights_node):
                    continue
                outside = [u.name for u in node.users if u not in region and u not in kept]
                _require(not outside, f"router intermediate {node.name} is also used by "
                                      f"{outside[0] if outside else ''}, outside the router region")
            _require_no_writes(nodes, [x, w, bias, score_bias])
            early = [u for out in [linear, ids_node, weights_node] + kept for u in out.users
                     if u not in region and u not in kept and order[u] < order[nodes[-1]]]
            _require(not early, f"{early[0].name if early else ''} reads a router output before the router ends")
            matches.append(RouterMatch(linear, weights_node, ids_node, nodes, x, w, bias, score_bias, spec, module,
                                       kept, compute_dtype))
        except Mismatch as exc:
            reasons = [interp.failures[n] for n in sorted(interp.failures, key=order.get)
                       if gu.module_path(n) == module]
            misses.append(NearMiss(topk_node, reasons[0] if reasons else str(exc), module, exc.expected, exc.actual,
                                   0, reasons + [str(exc)]))
    # A top-k that is itself a failed router step, or that a failed step on the router logits feeds
    # directly (a softmax over the wrong dim, say): a near miss. A top-k further away from the logits
    # (the load-balancing loss re-ranking the returned logits) is not a router.
    for node in graph.nodes:
        if gu.op_name(node) != "topk" or node in env:
            continue
        failed = [node] if node in interp.failures else \
            [a for a in node.all_input_nodes if a in interp.failures and any(b in env for b in a.all_input_nodes)]
        if failed:
            reason = interp.failures[failed[0]]
            misses.append(NearMiss(node, reason, gu.module_path(node), None, None, 0, [reason]))
    return matches, misses


def _autocast_cast(linear, x, w, cast32, autocast: AutocastView):
    """(compute dtype, label) of the router's linear: the dtype autocast cast its input and weight to (None where
    the logits have the dtype the code asks for), and a label naming the autocast (None where none is active,
    nothing needs checking). The logits' recorded dtype is the proof: a linear of fp32 operands returns
    bf16 only when autocast cast them (linear is on autocast's lower-precision list on CPU and CUDA)."""
    known, dtype = autocast.at(linear, device_type(linear) or "cpu")
    l_dtype = _dtype(linear)
    asked = torch.float32 if cast32 else _dtype(x)
    if l_dtype == asked or _dtype(x) != _dtype(w):
        return None, (describe(dtype) if dtype is not None or not known else None)
    label = describe(dtype) if known else "an autocast entered outside this graph"
    _require(l_dtype in (torch.float16, torch.bfloat16) and (not known or dtype in (None, l_dtype)),
             f"router logits are {l_dtype} from {_dtype(x)} inputs under {label}")
    return l_dtype, label


def _require_plain_dtypes(region, linear, label, order):
    """Every floating step after the linear must have the dtype it would have without autocast, given its
    inputs' dtypes: then the region computes as the same router of a model in the logits' dtype does, which
    the op matches. CUDA's autocast runs softmax and sum without a dtype argument in fp32 (its fp32 policy): a
    router that relies on the input dtype there runs unfused."""
    for node in sorted(region, key=order.get):
        if node is linear:
            continue
        t = gu.tensor_meta(node)
        name = gu.op_name(node) or ""
        if t is None or not t.dtype.is_floating_point or name.endswith("_"):
            continue
        want = plain_dtype(node, name)
        _require(want is None or want == t.dtype,
                 f"router step {node.name} ({name}) returns {t.dtype} under {label}, {want} without it (autocast's "
                 f"fp32 policy); the router op computes it in {want}: pass dtype= to keep it off that policy")


def _build_spec(fields, linear, x, w, bias, score_bias, cast32, weights_node, cast, compute_dtype=None) -> RouterSpec:
    x_dtype, w_dtype, l_dtype = _dtype(x), _dtype(w), _dtype(linear)
    if compute_dtype is not None:  # autocast: the op reads the input, weight and bias cast to the logits' dtype
        x_dtype = w_dtype = compute_dtype
        cast32 = False
    _require(x_dtype in (torch.float32, torch.float16, torch.bfloat16),
             f"router input is {x_dtype}; supported dtypes are float32, float16, bfloat16")
    _require(x_dtype == w_dtype, f"router input {x_dtype} and gate weight {w_dtype} differ")
    if bias is not None:
        _require(_dtype(bias) == _dtype(w), "router bias dtype differs from the gate weight's")
    num_experts, hidden_size = _shape(w)
    _require(gu.same_int(_shape(x)[1], hidden_size), "router input and gate weight disagree on the hidden size")
    _require(isinstance(num_experts, int), "the expert count is symbolic")
    if bias is not None:
        _require(_shape(bias) == (num_experts,), f"router bias {_shape(bias)} is not [{num_experts}]")
    if score_bias is not None:
        _require(_shape(score_bias) == (num_experts,), f"score-correction bias {_shape(score_bias)} is not "
                                                       f"[{num_experts}]")
        _require(_dtype(score_bias) is not None and _dtype(score_bias).is_floating_point,
                 "score-correction bias is not floating point")
    k = fields["top_k"]
    _require(1 <= k <= num_experts, f"top-k k={k} outside [1, {num_experts}]")
    n_group = fields.get("n_group", 1)
    group_size = fields.pop("group_size", None)
    if n_group > 1:
        _require(gu.same_int(group_size * n_group, num_experts),
                 f"the expert mask spans {n_group} groups of {group_size}, not the {num_experts} experts")
        _require(num_experts % n_group == 0 and num_experts // n_group >= 2,
                 f"{num_experts} experts in {n_group} groups")
        _require(1 <= fields["topk_group"] <= n_group, "topk_group outside [1, n_group]")
    linear_fp32 = cast32 and l_dtype == torch.float32
    _require(l_dtype == (torch.float32 if linear_fp32 else x_dtype),
             f"router logits are {l_dtype} from {_dtype(x)} input and {_dtype(w)} weight")
    weights_dtype = _dtype(weights_node)
    _require(weights_dtype in (torch.float32, torch.float16, torch.bfloat16), f"routing weights are {weights_dtype}")
    return RouterSpec(num_experts=num_experts, linear_fp32=linear_fp32, has_bias=bias is not None,
                      weights_dtype=weights_dtype, **fields)


def _require_no_writes(nodes, inputs):
    from .experts import _require_no_writes_to_inputs
    try:
        _require_no_writes_to_inputs(nodes, inputs)
    except Mismatch as exc:
        raise Mismatch(str(exc).replace("experts region", "router region")) from None
