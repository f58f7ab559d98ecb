"""Gate programs: the element-wise step between the two expert projections, as data.

HF families differ in what they do between ``gate_up_proj`` and ``down_proj``: SiLU- or GELU-gated
halves of a concatenated projection (Mixtral, Qwen, OLMoE, DeepSeek), clamped interleaved halves with
an ``alpha`` sigmoid (GPT-OSS), clamped SwiGLU (DeepSeek-V4, HY-V4), an fp32 upcast around the gate
(Beam), or no gate at all (``relu(x)**2``). The pattern matcher does not hard-code these: it records
whatever element-wise ops the graph applies, as a small expression tree over three leaves

    ["gate"], ["up"]   the two halves of the up projection (split "chunk" or "interleave")
    ["h"]              the whole up projection (split "none", models without a gate)

with nodes ``["call", name, [args], {kwargs}]`` and constants ``["const", v]`` / ``["dtype", "float32"]``.
The reference evaluates the same ops in the same order, so its result equals eager's bit for bit on
the same device. Kernels accept the programs they recognise (``classify``) and fall back otherwise.

Programs may read ``["operand", i]``, the i-th extra tensor input of the op: a 0-d tensor (a config
scalar such as GPT-OSS's clamp limit, which Dynamo lifts to a graph input under ``dynamic=True``) or,
in a post program, a vector broadcast over rows. The same language describes an optional *post program* applied to each row of the down projection
before the routing weight (HF's ``has_post_expert_norm``, an RMSNorm): leaf ``["y"]`` is the row,
``["operand", i]`` the i-th extra tensor of the op (a vector broadcast over rows, e.g. a norm weight),
and ``mean`` reduces over the row (``dim=-1, keepdim=True`` only).
"""
from __future__ import annotations

import json
import operator

import torch
import torch.nn.functional as F

SPLITS = ("chunk", "interleave", "none", "post")  # "post": a post program (leaf ["y"])


def _to(x, dtype):
    return x.to(dtype)


# name -> (callable, allowed keyword names). Only element-wise, shape-preserving ops belong here:
# the program maps each row of the up projection to one row of the down projection's input.
ELEMENTWISE_OPS = {
    "add": (operator.add, ()),
    "sub": (operator.sub, ()),
    "mul": (operator.mul, ()),
    "truediv": (operator.truediv, ()),
    "pow": (operator.pow, ()),
    "neg": (operator.neg, ()),
    "sigmoid": (torch.sigmoid, ()),
    "tanh": (torch.tanh, ()),
    "exp": (torch.exp, ()),
    "erf": (torch.erf, ()),
    "square": (torch.square, ()),
    "silu": (F.silu, ()),
    "relu": (F.relu, ()),
    "gelu": (F.gelu, ("approximate",)),
    "softplus": (F.softplus, ("beta", "threshold")),
    "clamp": (torch.clamp, ("min", "max")),
    "rsqrt": (torch.rsqrt, ()),
    "sqrt": (torch.sqrt, ()),
    "to": (_to, ()),
    "mean": (torch.mean, ("dim", "keepdim")),  # row-wise only: dim=-1, keepdim=True (checked by the matcher)
}
ROW_REDUCTIONS = ("mean",)

# silu(gate) * up: the SwiGLU activation of Mixtral, Qwen and most MoE families
SILU_GLU_EXPR = ["call", "mul", [["call", "silu", [["gate"]], {}], ["up"]], {}]

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def dtype_const(dtype: torch.dtype) -> list:
    return ["dtype", str(dtype).replace("torch.", "")]


def encode(split: str, expr) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown gate split {split!r}")
    return json.dumps({"split": split, "expr": expr}, separators=(",", ":"), sort_keys=True)


def decode(program: str) -> tuple[str, list]:
    data = json.loads(program)
    return data["split"], data["expr"]


def apply_post(expr, y: torch.Tensor, operands) -> torch.Tensor:
    """Evaluate a post program (a decoded expression) on down-projection rows ``y`` [rows, H]."""
    out = _eval(expr, {"y": y, "operands": list(operands)})
    if not isinstance(out, torch.Tensor):
        raise ValueError("uniep: a post program must produce a tensor")
    return out


def split_halves(h: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
    if split == "none":
        return {"h": h}
    if split == "chunk":
        gate, up = h.chunk(2, dim=-1)
    elif split == "interleave":
        gate, up = h[..., ::2], h[..., 1::2]
    else:
        raise ValueError(f"unknown gate split {split!r}")
    return {"gate": gate, "up": up}


def _eval(expr, leaves):
    kind = expr[0]
    if kind in ("gate", "up", "h", "y"):
        return leaves[kind]
    if kind == "operand":
        return leaves["operands"][expr[1]]
    if kind == "const":
        return expr[1]
    if kind == "dtype":
        return _DTYPES[expr[1]]
    if kind == "call":
        _, name, args, kwargs = expr
        fn, _allowed = ELEMENTWISE_OPS[name]
        return fn(*[_eval(a, leaves) for a in args], **{k: _eval(v, leaves) for k, v in kwargs.items()})
    raise ValueError(f"malformed gate program node {expr!r}")


def apply_gate(program: str, h: torch.Tensor, operands=()) -> torch.Tensor:
    """Evaluate a gate program on the up projection ``h`` ([rows, N]) -> [rows, N or N/2]."""
    return apply_decoded(*decode(program), h, operands)


def apply_decoded(split: str, expr, h: torch.Tensor, operands=()) -> torch.Tensor:
    """apply_gate on an already decoded program (no JSON parsing: torch.compile can trace this)."""
    out = _eval(expr, {**split_halves(h, split), "operands": list(operands)})
    if not isinstance(out, torch.Tensor):
        raise ValueError("uniep: a gate program must produce a tensor")
    return out


def describe(program: str) -> str:
    """A short human-readable rendering, for logs: ``silu(gate) * up``."""
    split, expr = decode(program)

    def show(e):
        if e[0] in ("gate", "up", "h", "y"):
            return e[0]
        if e[0] == "operand":
            return f"operand{e[1]}"
        if e[0] == "const":
            return repr(e[1])
        if e[0] == "dtype":
            return e[1]
        _, name, args, kwargs = e
        infix = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "pow": "**"}
        parts = [show(a) for a in args]
        if name in infix and len(parts) == 2 and not kwargs:
            return f"({parts[0]} {infix[name]} {parts[1]})"
        parts += [f"{k}={show(v)}" for k, v in kwargs.items()]
        return f"{name}({', '.join(parts)})"

    text = show(expr)
    return text if split in ("none", "post") else f"{text} [{split}]"


def _number(e) -> float | None:
    if e[0] == "const" and isinstance(e[1], (int, float)) and not isinstance(e[1], bool):
        return float(e[1])
    return None


def clamped_glu_params(program: str) -> tuple[float, float, float] | None:
    """(alpha, limit, up_add) of GPT-OSS's gate, ``(clamp(up, -limit, limit) + up_add) * g * sigmoid(g * alpha)``
    with ``g = clamp(gate, max=limit)``, or None for any other program."""
    split, expr = decode(program)
    if split not in ("chunk", "interleave") or expr[:2] != ["call", "mul"] or len(expr[2]) != 2 or expr[3]:
        return None
    up_part, glu = expr[2]
    if up_part[:2] != ["call", "add"] or up_part[3] or glu[:2] != ["call", "mul"] or glu[3]:
        return None
    up_clamp, up_add = up_part[2]
    gate_clamp, sig = glu[2]
    if up_clamp[:3] != ["call", "clamp", [["up"]]] or gate_clamp[:3] != ["call", "clamp", [["gate"]]]:
        return None
    limit = _number(up_clamp[3].get("max", ["const", None]))
    low = _number(up_clamp[3].get("min", ["const", None]))
    if limit is None or low != -limit or gate_clamp[3] != {"min": ["const", None], "max": ["const", up_clamp[3]["max"][1]]}:
        return None
    if sig[:2] != ["call", "sigmoid"] or sig[3] or len(sig[2]) != 1:
        return None
    scaled = sig[2][0]
    if scaled[:2] != ["call", "mul"] or scaled[3] or scaled[2][0] != gate_clamp:
        return None
    alpha, add = _number(scaled[2][1]), _number(up_add)
    if alpha is None or add is None:
        return None
    return alpha, limit, add


def classify(program: str) -> str | None:
    """Name the standard activations a fused kernel implements, or None for a custom program."""
    split, expr = decode(program)
    halves = split in ("chunk", "interleave")
    if halves and expr == SILU_GLU_EXPR:
        return "silu_glu"
    for approx in ("none", "tanh"):
        kw = {} if approx == "none" else {"approximate": ["const", "tanh"]}
        if halves and expr == ["call", "mul", [["call", "gelu", [["gate"]], kw], ["up"]], {}]:
            return "gelu_glu" if approx == "none" else "gelu_tanh_glu"
    if clamped_glu_params(program) is not None:
        return "clamped_swiglu"
    if split == "none" and expr in (["call", "square", [["call", "relu", [["h"]], {}]], {}],
                                    ["call", "pow", [["call", "relu", [["h"]], {}], ["const", 2]], {}]):
        return "relu2"
    return None
