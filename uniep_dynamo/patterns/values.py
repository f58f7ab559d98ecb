"""Abstract values for the experts pattern: what a graph node *means* in MoE terms.

The matcher interprets a Dynamo graph node by node and gives each node one of these values (or none,
when it is ordinary model code). Values describe tensors over the S = T*K routed slots:

    Rows(order, expr, shape)  one row per routed slot, in `order`; `expr` says what every row holds
    Order("flat", ids, K)     slot order t*K + k, as top_k_index.reshape(-1) has it
    Order("sorted", ids, K, sort)  the order of a sort of the flat expert ids (rows grouped by expert)

Row expressions are nested tuples:
    ("x", hidden)            the token's hidden state
    ("eid",)                 the slot's expert id          ("w", weights) the slot's routing weight
    ("W", param) ("B", param)  the slot's expert weight matrix / bias row (batched_mm gathers)
    ("lin", e, param, layout)  e @ W[expert] with W stored [E,out,in] ("oi") or [E,in,out] ("io")
    ("bias", e, param)       e + B[expert]
    ("half", i, split, e)    half i of e, split "chunk" or "interleave"
    ("ew", name, args, kwargs) an element-wise op (kernels/gate_program.ELEMENTWISE_OPS)
    ("weighted", e, weights) e * routing weight
    ("operand", node)        a vector broadcast over rows (e.g. a post-expert norm weight)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node


class Mismatch(Exception):
    """A node consumes MoE values in a way the experts op does not compute; the text says why, and
    where one bound value is at fault, `expected` and `actual` say what the pattern wanted and got."""

    def __init__(self, reason: str, expected=None, actual=None):
        super().__init__(reason)
        self.expected = None if expected is None else str(expected)
        self.actual = None if actual is None else str(actual)


@dataclass(frozen=True)
class Order:
    kind: str  # "flat" | "sorted"
    ids: Node | None  # the [T, K] expert-id tensor; None while unknown (rows from repeat_interleave)
    top_k: object  # K, an int or SymInt
    sort: Node | None = None  # the sort node, for "sorted"


@dataclass(frozen=True)
class Rows:
    order: Order
    expr: tuple
    shape: str  # "row" [S,N] | "vec" [S] | "vec_col" [S,1] | "col3" [S,N,1] | "row3" [S,1,N]
    #             | "mat" [S,a,b] | "bmm_col" [S,out,1] | "bmm_row" [S,1,out]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class SortPair:
    ids: Node
    top_k: object
    sort: Node


@dataclass(frozen=True)
class Perm:
    """The permutation returned by the sort: expert-sorted row r holds slot perm[r]."""
    ids: Node
    top_k: object
    sort: Node


@dataclass(frozen=True)
class SlotToken:
    """perm // K: the token of each expert-sorted row."""
    order: Order


@dataclass(frozen=True)
class SentinelMask:
    """expert_ids >= E over rows in `order`: HF's expert-parallel sentinel rows (all False without EP)."""
    order: Order


@dataclass(frozen=True)
class Counts:
    ids: Node
    num_experts: int


@dataclass(frozen=True)
class Offsets:
    ids: Node
    num_experts: int


@dataclass(frozen=True)
class WeightT:
    """param.transpose(-2, -1) of a 3-D expert weight."""
    param: Node


@dataclass(frozen=True)
class Halves:
    order: Order
    expr: tuple
    dtype: torch.dtype | None


@dataclass(frozen=True)
class InvPermBlank:
    sort: Node  # torch.empty_like(perm), about to become the inverse permutation


@dataclass(frozen=True)
class InvPerm:
    sort: Node


@dataclass(frozen=True)
class BlankRows:
    """torch.empty_like(rows): about to receive rows scattered back to slot order."""


@dataclass(frozen=True)
class Arange:
    end: object


@dataclass(frozen=True)
class Stacked:
    """Slot-order rows viewed as [T, K, H]."""
    expr: tuple
    ids: Node | None
    top_k: object


@dataclass(frozen=True)
class Combined:
    """sum over k of a Stacked: the experts region's [T, H] result."""
    expr: tuple
    ids: Node | None
    top_k: object
    dtype: torch.dtype | None = None


@dataclass
class NearMiss:
    node: Node
    reason: str
    module: str = ""
    expected: str | None = None
    actual: str | None = None
    matched_nodes: int = 0  # how far matching got: nodes of the module already read as MoE values
    rejections: list = field(default_factory=list)  # every failed check in the module, in graph order
    graph: str = ""  # the higher-order op body it lies in (patterns/bodies.py); "" for the Dynamo graph itself


@dataclass
class ExpertsMatch:
    """One experts region proven equal to torch.ops.uniep.moe_experts."""
    root: Node
    nodes: list
    hidden: Node
    topk_ids: Node
    topk_weights: Node
    w_up: Node
    w_down: Node
    b_up: Node | None
    b_down: Node | None
    spec: object  # ExpertsSpec
    module: str
    spelling: str  # "grouped_mm" | "batched_mm"
    post_operands: list = field(default_factory=list)  # vectors the post program reads (a norm weight)
    # Under autocast (patterns/autocast.py): the dtype the GEMMs run in where autocast casts the hidden states and
    # expert weights to it (None: they run in their own dtype). With or without autocast: the dtype the graph casts
    # the op's output to, as eager casts its K-sum's result (None: none; see experts._combine_dtypes)
    compute_dtype: torch.dtype | None = None
    out_cast: torch.dtype | None = None
