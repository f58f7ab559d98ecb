"""What uniep did to each graph, recorded while a `recording()` context is active.

Each Dynamo graph handed to the backend becomes a `GraphRecord`: its nodes before and after the
rewrite (identified by node name, which Dynamo derives from the source and keeps stable between
runs of the same code), each rewrite with the nodes it replaced, each near miss with its reason,
and, where the inner backend traces through AOTAutograd, how many uniep ops the forward and backward
graphs hold. `explain()` and the `uniep-diff` command build on this.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field

import torch
from torch.fx import Graph, Node

from .patterns import graph_utils as gu
from .patterns.bodies import walk

UNIEP_OPS = ("moe_experts", "moe_experts_backward", "moe_experts_backward_combine", "moe_router", "moe_router_backward",
             "moe_block",  # a router and an experts rewrite in one op (a graph that takes no gradient)
             "ep_dispatch", "ep_dispatch_backward", "ep_combine", "ep_combine_backward", "ep_exchange",
             "ep_exchange_backward_send", "ep_exchange_backward", "ep_layer", "ep_layer_backward")
_A2A = ("all_to_all", "this all-to-all runs in the inner backend: uniep fuses the token all-to-alls only where one "
        "graph holds the all-to-all, the experts and the all-to-all back (uniep.ep_exchange, patterns/ep.py)")
_UNSUPPORTED_ANCHORS = {
    "all_to_all_single": _A2A, "all_to_all_single_autograd": _A2A, "all_to_all": _A2A,
}


@dataclass
class NodeRecord:
    id: str
    op: str
    target: str
    args: list
    module: str
    source: str


@dataclass
class Rewrite:
    op: str
    module: str
    spelling: str
    spec: str
    replaced: list  # ids of the nodes the op call replaced
    added: list  # ids of the nodes added
    graph: str = ""  # the higher-order op body it lives in (wrap_body_0 under activation checkpointing); "" top level
    # whether a tensor the op call reads requires grad as Dynamo traced it (False: a frozen layer whose inputs need no
    # gradient either, or an op the graph runs with grad mode off that backend.mark_inference marked, which gets no
    # backward op); True where the graph does not say
    needs_grad: bool = True


@dataclass
class NearMissRecord:
    module: str
    anchor: str  # the node left unrewritten: a grouped GEMM or bmm (experts), a top-k (router)
    reason: str  # the first check that failed
    pattern: str = "experts"  # the closest pattern
    expected: str | None = None  # what that check wanted and got, where one bound value was at fault
    actual: str | None = None
    matched_nodes: int = 0  # how far matching got: nodes of the module read as part of the pattern
    rejections: list = field(default_factory=list)  # every failed check in the module, in graph order
    graph: str = ""  # the higher-order op body it lies in; "" top level


@dataclass
class GraphRecord:
    compile_id: str
    before: list = field(default_factory=list)
    after: list = field(default_factory=list)
    rewrites: list = field(default_factory=list)
    near_misses: list = field(default_factory=list)
    # uniep ops per AOTAutograd graph ("forward", "backward", "inference"); None: not traced
    aot_graphs: dict | None = None
    # uniep ops the Dynamo graph held as traced, before any rewrite: HF's EP layers, which hf_ep.py substitutes at trace
    # time (uniep.ep_layer), are not rewrites of the graph but would go unreported without this
    traced_ops: dict = field(default_factory=dict)
    # of those, the calls none of whose tensors requires grad (no backward op follows them)
    traced_without_grad: dict = field(default_factory=dict)

    def note_aot_graph(self, kind: str, graph) -> None:
        """Count the uniep ops of an AOTAutograd graph ("forward", "backward" or "inference"): a Graph, or a
        GraphModule, whose subgraph modules count too, each once (AOTAutograd keeps a nested compile region's body,
        which its calls share, as one: invoke_subgraph). Counts add up: where DDP's optimizer splits a Dynamo graph
        into pieces, the pieces share its record (ddp.py)."""
        self.aot_graphs = self.aot_graphs or {}
        counts = self.aot_graphs.setdefault(kind, {})
        graphs = [graph] if isinstance(graph, Graph) else \
            [m.graph for m in graph.modules() if isinstance(m, torch.fx.GraphModule)]
        for g in graphs:
            for op, n in count_uniep_ops(g).items():
                counts[op] = counts.get(op, 0) + n

    def coverage_gaps(self) -> list[str]:
        """Rewrites whose op is missing from the traced forward or backward graph, and HF EP layers traced as
        uniep.ep_layer (traced_ops) whose op, or its backward op, is missing there. A backward op is expected only
        for calls that read a tensor requiring grad (a frozen layer with frozen inputs has none)."""
        # HF's layers traced as one op, and the layers the rewrite made one op (the split sizes traced in one graph)
        layers = self.traced_ops.get("ep_layer", 0) + sum(1 for r in self.rewrites if r.op == "ep_layer")
        if self.aot_graphs is None or not (self.rewrites or layers):
            return []
        forward = {}  # under DDP's optimizer some pieces of one graph may trace as inference beside the others
        for kind in ("forward", "inference"):
            for op, n in self.aot_graphs.get(kind, {}).items():
                forward[op] = forward.get(op, 0) + n
        backward = self.aot_graphs.get("backward")

        def rewrites(op, grad=False):
            return sum(1 for r in self.rewrites if r.op == op and (r.needs_grad or not grad))
        gaps = []
        # an experts rewrite that an EP exchange took in (patterns/ep.py) runs inside uniep.ep_exchange and its
        # backward inside uniep.ep_exchange_backward; one whose exchange became a whole layer, inside uniep.ep_layer
        # and uniep.ep_layer_backward
        for kind, ops, op, suffix, count in (
                ("forward", forward, "moe_experts", "", rewrites("moe_experts")),
                ("forward", forward, "moe_router", None, rewrites("moe_router")),
                ("backward", backward, "moe_experts_backward", "_backward", rewrites("moe_experts", True))):
            if ops is None:  # no backward graph traced
                continue
            # the ops that took experts rewrites in, each named where a rewrite made one
            inside = [] if suffix is None else \
                [taker + suffix for taker in ("ep_exchange", "ep_layer") if rewrites(taker, bool(suffix))]
            taken = sum(rewrites(name.removesuffix("_backward"), bool(suffix)) for name in inside)
            within = sum(ops.get(name, 0) for name in inside)
            held = ops.get(op, 0) + min(taken, within) + (ops.get("moe_block", 0) if kind == "forward" else 0)
            if held < count:
                also = f" and {within} uniep.{' / '.join(inside)}" if taken else ""
                gaps.append(f"{kind} graph holds {ops.get(op, 0)} uniep.{op}{also} for {count} rewrites"
                            + (" needing a gradient" if kind == "backward" and count < rewrites("moe_experts") else ""))
        frozen = self.traced_without_grad.get("ep_layer", 0) + sum(1 for r in self.rewrites
                                                                  if r.op == "ep_layer" and not r.needs_grad)
        for kind, ops, op, count in (("forward", forward, "ep_layer", layers),
                                     ("backward", backward, "ep_layer_backward", layers - frozen)):
            if ops is not None and ops.get(op, 0) < count:
                gaps.append(f"{kind} graph holds {ops.get(op, 0)} uniep.{op} for {count} traced uniep.ep_layer"
                            + (" needing a gradient" if count < layers else ""))
        return gaps


def _target_name(node: Node) -> str:
    name = gu.op_name(node)
    if name is not None:
        return name
    return str(node.target)


def _arg_text(arg) -> str:
    if isinstance(arg, Node):
        return "%" + arg.name
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_arg_text(a) for a in arg) + "]"
    text = repr(arg)
    return text if len(text) <= 60 else text[:57] + "..."


def _source(node: Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    return f"{found[-1][0]}:{found[-1][1]}" if found else ""


def snapshot(graph: Graph, where: str = "") -> list[NodeRecord]:
    """The graph's nodes; those of a higher-order op's body `where` get ids prefixed by it (``wrap_body_0.mm``)."""
    return [NodeRecord(node_id(n.name, where), n.op, _target_name(n), [_arg_text(a) for a in n.args] +
                       [f"{k}={_arg_text(v)}" for k, v in n.kwargs.items()], gu.module_path(n), _source(n))
            for n in graph.nodes]


def node_id(name: str, where: str = "") -> str:
    return f"{where}.{name}" if where else name


class Recorder:
    def __init__(self):
        self.graphs: list[GraphRecord] = []

    def totals(self) -> dict:
        totals = {"moe_experts": 0, "moe_router": 0, "ep_dispatch": 0, "ep_exchange": 0, "ep_combine": 0, "unfused": 0,
                  "router_unmatched": 0, "ep_unmatched": 0, "all_to_all_unmatched": 0, "ep_layer": 0}
        for g in self.graphs:
            totals["ep_layer"] += g.traced_ops.get("ep_layer", 0)
            for op in ("moe_experts", "moe_router", "ep_dispatch", "ep_exchange", "ep_combine", "ep_layer"):
                totals[op] += sum(1 for r in g.rewrites if r.op == op)
            totals["ep_unmatched"] += sum(1 for m in g.near_misses if m.pattern == "ep")
            totals["unfused"] += sum(1 for m in g.near_misses if m.pattern == "experts")
            totals["router_unmatched"] += sum(1 for m in g.near_misses if m.pattern == "router")
            totals["all_to_all_unmatched"] += sum(1 for m in g.near_misses if m.pattern == "all_to_all")
        return totals

    def to_dict(self) -> dict:
        import torch

        from . import __version__

        return {"uniep": __version__, "torch": torch.__version__, "totals": self.totals(),
                "graphs": [asdict(g) | {"coverage_gaps": g.coverage_gaps()} for g in self.graphs]}


_ACTIVE: list[Recorder] = []


@contextlib.contextmanager
def recording():
    """Record every graph uniep compiles inside the block: `with recording() as rec: ...`."""
    recorder = Recorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


def active() -> bool:
    """Whether to record: inside `recording()`, or when TORCH_TRACE asks for structured traces."""
    return bool(_ACTIVE) or bool(os.environ.get("TORCH_TRACE"))


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        return str(CompileContext.current_compile_id())
    except Exception:  # noqa: BLE001  (outside a Dynamo compile)
        return "?"


def record_graph(before: list, after: list, gm, lowered: list, misses: list) -> GraphRecord:
    """Called by the backend after a rewrite while recording is active, with the snapshots of the graph and its
    bodies; `lowered` holds (match, names of the replaced nodes, names of the added nodes, body) per rewrite,
    `misses` (pattern, near miss) pairs. `publish` hands the record on."""
    record = GraphRecord(_compile_id(), before, after)
    nodes = {node_id(n.name, where): n for module, where, _ in walk(gm) for n in module.graph.nodes}
    for match, replaced, added, where in lowered:
        op = getattr(match, "op", None) or ("moe_router" if hasattr(match, "ids") else "moe_experts")
        calls = [nodes[i] for i in (node_id(n, where) for n in added) if i in nodes and uniep_op_of(nodes[i]) == op]
        record.rewrites.append(Rewrite(op, match.module, match.spelling, match.spec.describe(),
                                       [node_id(n, where) for n in replaced], [node_id(n, where) for n in added],
                                       where, needs_grad=not calls or any(map(needs_grad, calls))))
    for pattern, miss in misses:
        record.near_misses.append(NearMissRecord(miss.module, node_id(miss.node.name, miss.graph), miss.reason,
                                                 pattern, miss.expected, miss.actual, miss.matched_nodes,
                                                 list(miss.rejections), miss.graph))
    added = {node_id(n, where) for _, _, nodes, where in lowered for n in nodes}
    for module, where, _ in walk(gm):
        for node in module.graph.nodes:
            op = uniep_op_of(node)  # a uniep op the graph held as traced (not one a rewrite added)
            if op is not None and node_id(node.name, where) not in added:
                record.traced_ops[op] = record.traced_ops.get(op, 0) + 1
                if not needs_grad(node):
                    record.traced_without_grad[op] = record.traced_without_grad.get(op, 0) + 1
            name = gu.op_name(node)  # patterns that do not exist yet: every anchor of theirs is a near miss
            if name in _UNSUPPORTED_ANCHORS:
                pattern, reason = _UNSUPPORTED_ANCHORS[name]
                record.near_misses.append(NearMissRecord(gu.module_path(node), node_id(node.name, where), reason,
                                                         pattern, graph=where))
    return record


def publish(record: GraphRecord) -> None:
    """Hand a graph's record to the active recorders and the structured trace: the backend does so once the
    graph is compiled, so a compile Dynamo throws away (and traces again) is not reported twice."""
    for recorder in _ACTIVE:
        recorder.graphs.append(record)
    _emit_trace_artifact(record)


def _emit_trace_artifact(record: GraphRecord) -> None:
    """The record as a structured-trace artifact, so tlparse users see it beside inductor's output."""
    try:
        import json

        from torch._logging import trace_structured

        trace_structured("artifact", metadata_fn=lambda: {"name": "uniep_report", "encoding": "json"},
                         payload_fn=lambda: json.dumps(asdict(record)))
    except (ImportError, TypeError):  # a torch without structured tracing, or another signature
        pass


def needs_grad(node: Node) -> bool:
    """Whether a tensor the call reads requires grad as Dynamo traced it (its example values), so that AOTAutograd's
    backward graph holds the call's backward; True where no argument carries an example value (nothing to go by)."""
    values = []

    def visit(arg):
        if isinstance(arg, Node):
            value = gu.example(arg)
            if isinstance(value, torch.Tensor):
                values.append(value)
        elif isinstance(arg, (list, tuple)):
            for a in arg:
                visit(a)
    visit(list(node.args) + list(node.kwargs.values()))
    return not values or any(v.requires_grad for v in values)


def uniep_op_of(node) -> str | None:
    """The uniep op a node calls -- directly, or wrapped by auto-functionalization (the in-place
    backward under AOTAutograd) -- by name, the in-place backward counted as ``moe_experts_backward``."""
    if node.op != "call_function":
        return None
    target = node.target
    if "auto_functionalized" in str(target) and node.args:
        target = node.args[0]
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or "uniep" not in str(target):
        return None
    name = target.__name__.split(".")[0].rstrip("_")
    return name if name in UNIEP_OPS else None


def count_uniep_ops(graph: Graph) -> dict:
    counts = {}
    for node in graph.nodes:
        name = uniep_op_of(node)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts
