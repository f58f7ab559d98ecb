"""Reading Dynamo FX graphs one way, whatever the spelling: op names, arguments, shapes, constants.

Dynamo records ``x.sort()`` as call_method "sort", ``torch.sort(x)`` as call_function torch.sort and
``x // 2`` as operator.floordiv; ``op_name`` gives all three one canonical name and ``bind`` one set of
argument names, so the patterns never look at a spelling.
"""
from __future__ import annotations

import operator
import re

import torch
from torch.fx import Node

_OPERATOR_NAMES = {
    operator.getitem: "getitem", operator.setitem: "setitem", operator.floordiv: "floordiv",
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "truediv",
    operator.neg: "neg", operator.pow: "pow", operator.iadd: "add_", operator.imul: "mul_",
    operator.isub: "sub_", operator.itruediv: "div_", operator.ge: "ge", operator.gt: "gt",
}
_ALIASES = {
    "_grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm", "floor_divide": "floordiv",
    "multiply": "mul", "true_divide": "truediv", "div": "truediv", "clip": "clamp", "negative": "neg",
    "subtract": "sub", "sigmoid_": "sigmoid", "clip_": "clamp_",
}

# canonical name -> parameter names in positional order (first is the tensor, `self` for methods).
# "*shape" collects the remaining positional arguments as one tuple.
_SIGNATURES = {
    "reshape": ("input", "*shape"), "view": ("input", "*shape"), "flatten": ("input", "start_dim", "end_dim"),
    "sort": ("input", "dim", "descending"), "argsort": ("input", "dim", "descending"),
    "histc": ("input", "bins", "min", "max"), "bincount": ("input", "weights", "minlength"),
    "cumsum": ("input", "dim"), "chunk": ("input", "chunks", "dim"),
    "grouped_mm": ("input", "weight", "offs"), "bmm": ("input", "mat2"),
    "transpose": ("input", "dim0", "dim1"), "unsqueeze": ("input", "dim"), "squeeze": ("input", "dim"),
    "sum": ("input", "dim", "keepdim"), "repeat_interleave": ("input", "repeats", "dim"),
    "empty_like": ("input",), "zeros_like": ("input",), "arange": ("end",),
    "floordiv": ("input", "other"), "getitem": ("input", "index"), "setitem": ("input", "index", "value"),
    "to": ("input", "*args"), "type": ("input", "dtype"), "masked_fill": ("input", "mask", "value"),
    "masked_fill_": ("input", "mask", "value"), "clamp": ("input", "min", "max"), "clamp_": ("input", "min", "max"),
    "ge": ("input", "other"), "gt": ("input", "other"),
}
_DEFAULTS = {
    "flatten": {"start_dim": 0, "end_dim": -1}, "sort": {"dim": -1, "descending": False},
    "argsort": {"dim": -1, "descending": False},
    "histc": {"bins": 100, "min": 0, "max": 0}, "bincount": {"weights": None, "minlength": 0},
    "cumsum": {"dtype": None}, "chunk": {"dim": 0}, "grouped_mm": {"offs": None, "bias": None, "out_dtype": None},
    "squeeze": {"dim": None}, "sum": {"dim": None, "keepdim": False, "dtype": None},
    "repeat_interleave": {"dim": None, "output_size": None}, "clamp": {"min": None, "max": None},
    "clamp_": {"min": None, "max": None},
}
# keyword names that other spellings use for the same parameter
_KW_ALIASES = {"self": "input", "mat_a": "input", "mat_b": "weight", "a": "input", "b": "weight"}


class NotConstant(Exception):
    pass


# Python's in-place operators by name (``operator.imul``; ``__imul__`` stripped of its underscores): each writes its
# first argument
IN_PLACE_OPERATORS = ("setitem", "delitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
                      "ilshift", "irshift", "iand", "ixor", "ior", "iconcat")


def is_in_place(node: Node) -> bool:
    """Whether a node writes its first argument in place, by its name (``mul_``, ``operator.imul``, ``setitem``), or
    a tensor given as ``out=``."""
    name = op_name(node) or ""
    return name == "setitem" or (name.endswith("_") and not name.startswith("_")) or \
        node.kwargs.get("out") is not None


def op_name(node: Node) -> str | None:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        target = node.target
        if target in _OPERATOR_NAMES:
            name = _OPERATOR_NAMES[target]
        elif isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            name = target.__name__.split(".")[0]
        else:
            name = getattr(target, "__name__", None)
            if name is None:
                return None
    else:
        return None
    return _ALIASES.get(name, name)


def bind(node: Node, name: str) -> dict:
    """Arguments of a call by canonical parameter name, defaults filled in."""
    params = _SIGNATURES.get(name)
    out = dict(_DEFAULTS.get(name, {}))
    args = list(node.args)
    if params is None:
        params = ("input", "other")
    for i, param in enumerate(params):
        if param.startswith("*"):
            rest = args[i:]
            if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
                rest = list(rest[0])
            out[param[1:]] = tuple(rest)
            break
        if i < len(args):
            out[param] = args[i]
    for key, value in node.kwargs.items():
        out[_KW_ALIASES.get(key, key)] = value
    return out


def example(node) -> object:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def tensor_meta(node) -> torch.Tensor | None:
    ev = example(node)
    return ev if isinstance(ev, torch.Tensor) else None


def constant(arg):
    """The value of an argument known at compile time: python constants, or the SymInt/SymFloat/dtype
    a scalar node stands for. Raises NotConstant for tensors."""
    if isinstance(arg, Node):
        ev = example(arg)
        if isinstance(ev, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype)):
            return ev
        raise NotConstant(arg)
    if isinstance(arg, (tuple, list)):
        return type(arg)(constant(a) for a in arg)
    return arg


def same_int(a, b) -> bool:
    """a == b provably (for every value of the symbols), ints or SymInts."""
    if isinstance(a, bool) or isinstance(b, bool):
        return False
    if not isinstance(a, (int, torch.SymInt)) or not isinstance(b, (int, torch.SymInt)):
        return False
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return bool(statically_known_true(a == b))
    return a == b


def same_int_or_guard(a, b) -> bool:
    """a == b provably, or, for sizes Dynamo traced with equal values but separate symbols (two graph
    inputs whose relation no op in the graph states), by a guard on a == b: the compiled graph then runs
    only on calls where they are equal, and a call where they differ compiles another graph."""
    if same_int(a, b):
        return True
    if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(x, (int, torch.SymInt)) for x in (a, b)):
        return False
    from torch.fx.experimental.symbolic_shapes import guard_bool

    def hint(x):  # the value this trace saw; None for an unbacked size
        return x if isinstance(x, int) else (x.node.hint if x.node.has_hint() else None)

    if hint(a) is None or hint(a) != hint(b):
        return False
    return bool(guard_bool(a == b))


def is_dim(value, want: int, ndim: int) -> bool:
    """Whether `value` names dimension `want` (non-negative) of an ndim tensor."""
    if isinstance(value, bool) or not isinstance(value, int) or not -ndim <= value < ndim:
        return False
    return value % ndim == want


def module_path(node: Node) -> str:
    """`model.layers.3.mlp.experts` for a node inside that module, from Dynamo's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root module>"
    key, _cls = list(stack.values())[-1]
    path = re.sub(r"^L\['(self|fn|mod|model)'\]\.?", "", key)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path).lstrip(".")
    return path or "<root module>"
