"""Turning the element-wise parts of a matched region into gate and post programs."""
from __future__ import annotations

from ..kernels import gate_program
from .interpreter import _ndim
from .values import Mismatch

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
