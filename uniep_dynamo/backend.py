"""The torch.compile backend: rewrite MoE regions, then hand the graph to the inner backend.

    torch.compile(model, backend="uniep")                                   # inductor behind us
    torch.compile(model, backend="uniep", options={"inner_backend": "eager"})

Options (``options={...}``): see ``UniepOptions``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import operator
import os
from dataclasses import dataclass, field, fields

import torch
from torch._dynamo.utils import counters

from . import capture, checkpoint_effects, ddp, hf_ep, report
from .spec import decode_spec
from .lowering import (lower_combine, lower_dispatch, lower_exchange, lower_experts, lower_layer, lower_router,
                       share_routing_plan)
from .patterns import find_ep_regions, find_experts_regions, find_layers, find_router_regions
from .patterns.bodies import walk
from .patterns.graph_utils import IN_PLACE_OPERATORS, module_path, op_name

log = logging.getLogger("uniep")

INNER_BACKENDS = ("inductor", "eager", "aot_eager", "tensorrt")

checkpoint_effects.install()  # a no-op for other backends' compiles (checkpoint_effects.py)


@dataclass(frozen=True)
class UniepOptions:
    inner_backend: object = "inductor"  # a name from INNER_BACKENDS, or any torch.compile backend callable
    rewrite_experts: bool = True  # False: leave the experts regions as Dynamo made them (for A/B comparisons)
    rewrite_router: bool = True  # False: leave the router regions to the inner backend
    # The router op also builds the routing plan its experts op consumes (one sort of the ids, in the
    # router's pass); False: the experts op builds its own (for A/B comparisons)
    share_routing_plan: bool = True
    # Expert parallelism: the all-to-all dispatch plan with its count exchange, and the combine after the
    # return all-to-all (patterns/ep.py); False leaves them to the inner backend
    rewrite_ep: bool = True
    # Under expert parallelism, the token all-to-all, the local experts and the all-to-all back, where one
    # graph holds all three, become one uniep.ep_exchange: the same steps in one op, which takes the dispatch's
    # count table and the received rows' routing plan in one launch (ep/exchange.py). False leaves them as
    # written around uniep.moe_experts (for A/B comparisons)
    rewrite_ep_exchange: bool = True
    # ...and that exchange's transfers run beside the grouped GEMMs, chunk by chunk (uniep_dynamo/ep/). Off by
    # default: on 2 H200s it is 1.00-1.02x inductor on the Mixtral shape and 0.82-1.08x on Qwen3-30B-A3B, where it
    # is host-bound and its step time erratic (BENCHMARKS.md). Where HF's EP layer keeps its plan on the device
    # (ep_device_plan), the device plan's pipeline runs instead (ep/device_pipeline.py): on HF's 4-layer models
    # (2026-11-28) 1.04x the device plan's steps one after another back to back on Qwen3-30B-A3B dims at 4 H200s,
    # 1.01x at 2, but 0.99x on Mixtral-8x7B dims at 2, so it stays off by default
    overlap_ep: bool = False
    # HF's EP layer (uniep.ep_layer) with its routing plan kept on the device: no host synchronization in the layer,
    # so the host runs ahead of the GPU (ep/device_plan.py: device-side split sizes, symmetric-memory windows sized
    # for the most rows a rank can receive). "auto" (the default): on CUDA, where the EP group's GPUs share one host
    # and the buffers it holds above the synchronized path's at the worst case fit in 1/16 of the GPU's memory
    # (ep/device_choice.py; measured on HF's 4-layer Qwen3-30B-A3B-dims model at 2 ranks: 1.09x /
    # 1.17x inductor synchronized / back to back against the synchronized path's 1.01x / 1.00x, its back-to-back
    # spread within 5%, 0.87 GiB more memory; BENCHMARKS.md). True: wherever it can run (else the synchronized path,
    # with a warning); False: never
    ep_device_plan: bool | str = "auto"
    # OverlapConfig fields for those exchanges (ep/config.py), e.g. {"chunks": 8, "copy_kernel": True}
    ep_knobs: dict = field(default_factory=dict)
    inductor: dict = field(default_factory=dict)  # inductor config patches, as torch.compile(options=...) takes
    # The experts backward reuses the forward's saved buffers (lower peak memory); a second backward
    # through the same graph (retain_graph=True) then raises. False keeps them intact.
    reuse_saved_buffers: bool = True
    # Where a graph ends with an EP dispatch whose split sizes go to the host (plain PyTorch EP code's `.tolist()` of
    # them: Dynamo breaks the graph there, and the layer lands in two graphs, three ops and a host synchronization),
    # Dynamo traces that frame again with that one read traced as unbacked ints (capture_scalar_outputs for that call
    # site only, in uniep's compiles: capture.py), so that the layer is one graph and one uniep.ep_layer. False: the
    # two graphs as Dynamo made them
    capture_ep_sizes: bool = True
    # Python side effects inside an activation-checkpoint body (every HF decoder layer since transformers 5.25: the
    # kernels package's context variable around the attention; HF's output capture hooks) traced and applied once,
    # in the forward, as torch's skip_fwd_side_effects_in_bwd_under_checkpoint does, in uniep's compiles only
    # (checkpoint_effects.py). False: Dynamo's graph break there, and the checkpointed layer runs eagerly, unfused
    trace_checkpoint_side_effects: bool = True

    @classmethod
    def from_options(cls, options: dict | None) -> "UniepOptions":
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"uniep: unknown option(s) {unknown}; known options are {sorted(known)}")
        for name, value in options.items():
            _check_type(name, value, cls.__dataclass_fields__[name].type)
        opts = cls(**options)
        if opts.ep_knobs:
            from .ep import OverlapConfig

            OverlapConfig(**opts.ep_knobs)  # a bad field or value fails here, at compile time
        if opts.overlap_ep and not opts.rewrite_ep_exchange:
            raise ValueError("uniep: overlap_ep=True overlaps the exchange that rewrite_ep_exchange=False leaves "
                             "unfused; drop one of them")
        if isinstance(opts.inner_backend, str) and opts.inner_backend not in INNER_BACKENDS:
            raise ValueError(f"uniep: inner_backend {opts.inner_backend!r} is not one of {INNER_BACKENDS} "
                             "(or pass a backend callable)")
        return opts


def _check_type(name: str, value, annotation: str) -> None:
    """A bool option takes True or False only (not 0, 1 or "no"), a dict option a dict; inner_backend a name
    (checked against INNER_BACKENDS afterwards) or a backend callable."""
    if name == "inner_backend":
        ok, expected = isinstance(value, str) or callable(value), \
            f"one of {INNER_BACKENDS} or a torch.compile backend callable"
    elif annotation == "bool | str":  # ep_device_plan
        ok, expected = isinstance(value, bool) or value == "auto", 'True, False or "auto"'
    else:
        kind = {"bool": bool, "dict": dict, "int": int, "float": float, "str": str}[annotation]
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        expected = "a bool (True or False)" if kind is bool else f"a {annotation}"
    if not ok:
        raise ValueError(f"uniep: option {name}={value!r} ({type(value).__name__}); {name} takes {expected}")


def rewrite_graph(gm: torch.fx.GraphModule, opts: UniepOptions | None = None, commit: bool = True):
    """Rewrite every proven experts, router and expert-parallel region of `gm` in place, and of the bodies of
    its higher-order ops (activation checkpointing and the like, patterns/bodies.py). Returns
    (matches, near_misses); per graph, matches hold the experts matches first, then the router, then the EP ones.

    The counters and the report take this graph's rewrites now, or, with ``commit=False``, when
    ``commit_rewrites(gm)`` is called: the backend calls it once the inner backend has compiled the graph, since
    Dynamo throws away a graph whose compile raises (a restart of its analysis, see ``uniep_backend``)."""
    opts = opts or UniepOptions()
    recording = report.active()
    before = _snapshot(gm) if recording else None
    lowered, matches, misses, counts = [], [], [], collections.Counter()
    for module, where, kind in walk(gm):
        _rewrite_one(module, opts, where, kind, lowered, matches, misses, counts)
    record = None
    if before is not None:
        record = gm.meta["uniep_record"] = report.record_graph(before, _snapshot(gm), gm, lowered, misses)
    gm.meta[_UNCOMMITTED] = (counts, record)
    if commit:
        commit_rewrites(gm)
    return matches, [miss for _, miss in misses]


def _snapshot(gm: torch.fx.GraphModule) -> list:
    """The report's rows of ``gm``'s graph and of its higher-order ops' bodies."""
    return [row for module, where, _ in walk(gm) for row in report.snapshot(module.graph, where)]


_SIZES_ON_HOST = "uniep_sizes_on_host"  # gm.meta: a graph of it ends with an EP dispatch whose split sizes leave it


def sizes_on_host(gm) -> bool:
    """Whether the rewrite of ``gm`` (or of a body in it) found an EP dispatch whose split sizes leave the graph."""
    return any(module.meta.get(_SIZES_ON_HOST) for module, _, _ in walk(gm))


def keep_layers_whole(gm, opts: UniepOptions) -> None:
    """Where a graph of ``gm`` ends with an EP dispatch whose split sizes go to the host: have Dynamo trace the frame
    again with that read captured (capture.py; raises Dynamo's restart, and the graph is dropped) where
    capture_ep_sizes is on and that can be done, else say once, at info level, that the layer stays in two graphs."""
    if not sizes_on_host(gm):
        return
    if opts.capture_ep_sizes:
        capture.trace_again_capturing_sizes(gm)
    from .kernels.megakernel import warn_once

    warn_once("ep_dispatch", "split sizes read between two graphs",
              "uniep: an EP dispatch's %s (a synchronization each layer); in plain PyTorch EP code like "
              "examples/ep_moe.py, capture_ep_sizes=True (the default, where Dynamo's trace can be restarted) or "
              "torch._dynamo.config.capture_scalar_outputs = True keeps the layer in one graph, which uniep runs as "
              "one uniep.ep_layer with its plan on the device", logging.INFO)


_UNCOMMITTED = "uniep_uncommitted"  # gm.meta: (counts, GraphRecord or None) of a rewrite not yet counted


def commit_rewrites(gm: torch.fx.GraphModule) -> None:
    """Add the rewrites and near misses rewrite_graph(gm, commit=False) found to counters["uniep"] and to the
    active recorders; once (a second call finds nothing left)."""
    counts, record = gm.meta.pop(_UNCOMMITTED, (collections.Counter(), None))
    for name, count in counts.items():
        counters["uniep"][name] += count
    if record is not None:
        report.publish(record)


def _number_site(node: torch.fx.Node, index: int, site: int, taken: list) -> None:
    """Give an op traced with an unnumbered spec under reuse_saved (HF's EP layer, substituted while Dynamo traced)
    the site number ``site`` (ExpertsSpec.site), as lower_experts numbers the experts ops it makes: two such calls on
    the same inputs then stay two ops, each with the buffers its in-place backward reads (``taken``: the numbers in
    use, appended to)."""
    spec = node.args[index]
    if not isinstance(spec, str):
        return
    s = decode_spec(spec)
    if s.reuse_saved and not s.site:
        node.args = node.args[:index] + (dataclasses.replace(s, site=site).encode(),) + node.args[index + 1:]
        taken.append(site)


def _rewrite_one(gm: torch.fx.GraphModule, opts: UniepOptions, where: str, kind: str, lowered: list, found: list,
                 near_misses: list, counts: collections.Counter) -> None:
    """Rewrite the regions of one graph (the Dynamo graph, or a body `where` of the given kind), appending
    (match, names of the nodes it replaced, names of the nodes added, where) to `lowered`, the matches to
    `found` and (pattern, near miss) to `near_misses`, and counting rewrites by op and near misses in `counts`."""
    inside = f" in {where} ({kind})" if where else ""
    matches, misses = find_experts_regions(gm.graph) if opts.rewrite_experts else ([], [])
    routers, router_misses = find_router_regions(gm.graph) if opts.rewrite_router else ([], [])
    taken = {n for m in matches for n in m.nodes}
    routers = [r for r in routers if taken.isdisjoint(r.nodes) and taken.isdisjoint(r.kept)]  # one rewrite per node
    experts_calls = []
    # Experts first: their calls read the router's ids and weights nodes, which the router lowering
    # then rewires to its own outputs.
    for match in matches:
        replaced = [n.name for n in match.nodes]
        call = lower_experts(gm, match, reuse_saved=opts.reuse_saved_buffers)
        experts_calls.append(call)
        lowered.append((match, replaced, [call.name] + [u.name for u in call.users], where))
        counts["moe_experts"] += 1
        log.info("uniep: rewrote %s (%s spelling, %d nodes)%s into uniep.moe_experts [%s]",
                 match.module, match.spelling, len(match.nodes), inside, match.spec.describe())
    for match in routers:
        replaced = [n.name for n in match.nodes]
        call = lower_router(gm, match)
        if opts.share_routing_plan and share_routing_plan(gm, call, experts_calls) is not None:
            match.spec = dataclasses.replace(match.spec, plan=True)
        lowered.append((match, replaced, [call.name] + [u.name for u in call.users], where))
        counts["moe_router"] += 1
        log.info("uniep: rewrote %s (%d nodes)%s into uniep.moe_router [%s]", match.module, len(match.nodes), inside,
                 match.spec.describe())
    ep_matches, ep_misses = find_ep_regions(gm.graph, exchange=opts.rewrite_ep_exchange) if opts.rewrite_ep \
        else ([], [])
    # exchanges last: a combine's match holds the exchange's last node as its rows, which an exchange lowered
    # first would have replaced
    ep_matches.sort(key=lambda m: ("ep_dispatch", "ep_combine", "ep_exchange").index(m.op))
    replaced_by = {}  # a node a lowering replaced -> what replaced it: a later match in this graph may hold it
    for i, match in enumerate(ep_matches):
        match = ep_matches[i] = _refreshed(match, replaced_by)
        replaced = [n.name for n in match.nodes]
        if match.op == "ep_exchange":
            call = lower_exchange(gm, match, opts.ep_knobs, sequential=not opts.overlap_ep)
        elif match.op == "ep_dispatch":
            call = lower_dispatch(gm, match, gather_counts=opts.rewrite_ep_exchange, replaced_by=replaced_by)
        else:
            call = lower_combine(gm, match)
        lowered.append((match, replaced, [call.name] + [u.name for u in call.users], where))
        counts[match.op] += 1
        log.info("uniep: rewrote %s (%d nodes)%s into uniep.%s [%s]", match.module, len(match.nodes), inside,
                 match.op, match.spec.describe())
    made = _lower_layers(gm, opts, where, ep_matches, lowered, counts) if ep_matches else set()
    layers = [n for n in gm.graph.nodes if n.op == "call_function"
              and n.target in (torch.ops.uniep.ep_layer, torch.ops.uniep.ep_layer.default)]
    sites = [decode_spec(n.args[7]).site for n in layers if isinstance(n.args[7], str)]
    for node in layers:  # HF's EP layers, traced as one op (hf_ep.py): numbered, counted and logged here
        if node not in made:
            _number_site(node, 7, 1 + max(sites, default=0), sites)
            counts["ep_layer"] += 1
            log.info("uniep: %s%s is one uniep.ep_layer (HF's AllToAllEP, substituted while Dynamo traced)",
                     module_path(node), inside)
    for pattern, found_misses, counter, what in (("experts", misses, "unfused", "%s"),
                                                 ("router", router_misses, "router_unfused", "router %s"),
                                                 ("ep", ep_misses, "ep_unfused", "expert-parallel step in %s")):
        for miss in found_misses:
            miss.graph = where
            counts[counter] += 1
            log.warning("uniep: " + what + "%s runs unfused: %s", miss.module, inside, miss.reason)
            near_misses.append((pattern, miss))
    found.extend(matches + routers + ep_matches)
    if matches or routers or ep_matches:
        # No graph-wide eliminate_dead_code here: Dynamo graphs hold in-place ops without users
        # (scatter_ into a mask, say) that FX's DCE would drop. The lowering erased its own region.
        gm.graph.lint()
        gm.recompile()


def _refreshed(match, replaced_by: dict):
    """``match`` with each node field an earlier lowering in this graph replaced (and erased) swapped for its
    replacement: where one graph holds the dispatch and the exchange or combine (split sizes traced,
    ``capture_scalar_outputs``), they read the dispatch's rows, order and counts."""
    changes = {f.name: replaced_by[v] for f in dataclasses.fields(match)
               if isinstance(v := getattr(match, f.name), torch.fx.Node) and v in replaced_by}
    return dataclasses.replace(match, **changes) if changes else match


def _lower_layers(gm, opts: UniepOptions, where: str, ep_matches: list, lowered: list, counts) -> set:
    """Where one graph holds a layer's dispatch, exchange and combine (Dynamo traced the split sizes as unbacked ints:
    ``torch._dynamo.config.capture_scalar_outputs = True``), the three calls become one uniep.ep_layer, which reads
    no count on the host where its plan stays on the device (``ep_device_plan``). Their entries in ``lowered`` and
    ``ep_matches`` become the layer's, and the counts move to ``ep_layer``. Returns the ep_layer calls made."""
    from .ep.device_choice import mode

    layers, reasons = find_layers(gm.graph) if opts.rewrite_ep_exchange else ([], [])
    for dispatch, reason in reasons:
        log.info("uniep: the EP layer of %s stays three ops, its split sizes read on the host: %s",
                 module_path(dispatch), reason)
    if opts.rewrite_ep_exchange and not layers and any(m.op == "ep_dispatch" for m in ep_matches) \
            and not any(m.op == "ep_exchange" for m in ep_matches):
        gm.meta[_SIZES_ON_HOST] = True  # uniep_backend may have Dynamo trace the frame again (capture_ep_sizes)
    made = set()
    for match in layers:
        names = {c.name for c in match.calls}
        merged = [entry for entry in lowered if entry[3] == where and entry[2] and entry[2][0] in names]
        added_before = {n for entry in merged for n in entry[2]}
        replaced = [n for entry in merged for n in entry[1]] + [n.name for n in match.nodes
                                                                if n.name not in added_before]
        call = lower_layer(gm, match, mode(opts.ep_device_plan))
        made.add(call)
        for entry in merged:
            lowered.remove(entry)
            counts[entry[0].op] -= 1
        ep_matches[:] = [m for m in ep_matches if not any(m is entry[0] for entry in merged)] + [match]
        lowered.append((match, replaced, [call.name] + [u.name for u in call.users], where))
        counts["ep_layer"] += 1
        log.info("uniep: rewrote the EP layer of %s (%d nodes)%s into uniep.ep_layer [%s]", match.module,
                 len(replaced), f" in {where}" if where else "", match.spec.describe())
    return made


def mark_inference(gm: torch.fx.GraphModule, nodes: set | None = None) -> int:
    """Mark the experts ops of a graph that takes no gradient (ExpertsSpec.inference), or those among ``nodes`` (the
    ones a graph runs with grad mode off: _no_grad_nodes), where the graph reads only their first output: small
    calls may then replay a CUDA graph of the op's own (kernels/op_graphs.py), whose other outputs hold no values.
    Returns how many were marked.

    A marked op whose routed slots are at most op_graphs.MAX_SLOTS in the traced graph (a decode step's static shape)
    computes its routing plan itself, inside that CUDA graph, instead of taking the router op's (share_routing_plan):
    the router then issues no plan launch and the graph copies in no plan. The plan is the same either way (the same
    ids, the same deterministic plan), so are the bits. A marked op whose router op feeds it alone becomes one
    uniep.moe_block with it, at every size (_fuse_block)."""
    from .kernels import op_graphs
    from .patterns import graph_utils as gu

    marked = 0
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.uniep.moe_experts.default or not isinstance(node.args[8], str):
            continue
        if nodes is not None and node not in nodes:  # (a node that may record a backward)
            continue
        if not all(user.target is operator.getitem and user.args[1] == 0 for user in node.users):
            continue
        spec = decode_spec(node.args[8])
        if spec.inference:
            continue
        node.args = node.args[:8] + (dataclasses.replace(spec, inference=True).encode(),) + node.args[9:]
        marked += 1
        _note_in_report(gm, node, "moe_experts", spec.describe() + f"; on CUDA, {_graphed_calls()} replay the op's "
                        "CUDA graph")
        ids = gu.tensor_meta(node.args[1])
        slots = ids.numel() if ids is not None else None
        if node.kwargs.get("plan_row_order") is not None and isinstance(slots, int) and slots <= op_graphs.MAX_SLOTS:
            _unshare_plan(gm, node)
        if nodes is not None:  # in a graph that has a backward, this op (and its router, if fused) gets no backward op
            _no_backward_in_report(gm, node)
        _fuse_block(gm, node, nodes)
    if marked:
        gm.graph.lint()
        gm.recompile()
        record = gm.meta.get("uniep_record")
        if record is not None:  # the report's "after" is the graph that runs
            record.after = _snapshot(gm)
    return marked


def _unshare_plan(gm: torch.fx.GraphModule, experts: torch.fx.Node) -> None:
    """Undo share_routing_plan for this experts op: it builds its own plan again, and the router op that built the
    given one stops building it where nothing else reads it."""
    from .spec import decode_router_spec

    given = [experts.kwargs[k] for k in ("plan_row_order", "plan_slot_row", "plan_offsets")]
    experts.kwargs = {k: v for k, v in experts.kwargs.items() if not k.startswith("plan_")}
    routers = {g.args[0] for g in given if g.target is operator.getitem}
    erased = set()
    for g in given:
        if not g.users and g.target is operator.getitem:
            gm.graph.erase_node(g)
            erased.add(g.name)
    _drop_from_report(gm, erased)
    for router in routers:
        if router.target is not torch.ops.uniep.moe_router.default:
            continue
        if any(u.target is operator.getitem and u.args[1] in (3, 4, 5) for u in router.users):
            continue  # another reader of its plan
        spec = dataclasses.replace(decode_router_spec(router.args[4]), plan=False)
        router.args = router.args[:4] + (spec.encode(),)
        _note_in_report(gm, router, "moe_router", spec.describe())


def _fuse_block(gm: torch.fx.GraphModule, experts: torch.fx.Node, nodes: set | None = None) -> bool:
    """A marked experts op whose top-k ids and weights come from a router op that nothing else reads, and the router
    op, become one uniep.moe_block (ops.moe_block: one call where there were two, and for a decode-sized call one
    CUDA graph of both). Proven from the graph: the router's outputs 1 and 2 are read by this op alone, as its
    weights and ids, and its plan (3-5) by this op alone as its plan (share_routing_plan: the block's router then
    builds it and its experts take it) or by nothing; its logits (0) by nothing; the experts op takes no post
    operands; nothing between the two writes in place; both are among ``nodes`` (where given: the nodes run with
    grad mode off). Returns whether it fused them."""
    from .spec import decode_router_spec

    ids, weights = experts.args[1], experts.args[2]
    plan = [experts.kwargs.get(k) for k in ("plan_row_order", "plan_slot_row", "plan_offsets")]
    shared = plan[0] is not None
    if experts.args[7] or set(experts.kwargs) - {"plan_row_order", "plan_slot_row", "plan_offsets"} or \
            not all(isinstance(a, torch.fx.Node) and a.target is operator.getitem
                    for a in (ids, weights) + (tuple(plan) if shared else ())):
        return False
    router = ids.args[0]
    if nodes is not None and router not in nodes:  # (a router that may record a backward)
        return False
    wanted = {ids: 2, weights: 1} | ({p: 3 + i for i, p in enumerate(plan)} if shared else {})
    if router.target is not torch.ops.uniep.moe_router.default or \
            any(n.args[0] is not router or n.args[1] != i for n, i in wanted.items()):
        return False
    for user in router.users:
        if user.target is not operator.getitem:
            return False
        if user in wanted:
            if set(user.users) != {experts}:
                return False
        elif user.users:
            return False
    # the block runs the router where the experts op ran: nothing in between may write what the router reads
    order = list(gm.graph.nodes)
    if any(_may_write(n) for n in order[order.index(router) + 1:order.index(experts)]):
        return False
    if nodes is not None:
        _no_backward_in_report(gm, router)
    outputs = [u for u in experts.users if u.args[1] == 0]
    rspec = dataclasses.replace(decode_router_spec(router.args[4]), plan=shared)
    with gm.graph.inserting_before(experts):
        block = gm.graph.call_function(torch.ops.uniep.moe_block.default, tuple(router.args[:4]) + (
            rspec.encode(), experts.args[0]) + tuple(experts.args[3:7]) + (experts.args[8],))
    if outputs:
        block.meta.update(outputs[0].meta)
    for out in outputs:
        out.replace_all_uses_with(block)
    erased = outputs + [experts] + list(router.users) + [router]
    for node in erased:
        gm.graph.erase_node(node)
    names = {n.name for n in erased}
    record = gm.meta.get("uniep_record")
    for rewrite in record.rewrites if record is not None else ():
        if not rewrite.graph and (experts.name in rewrite.added or router.name in rewrite.added):
            rewrite.added.append(block.name)
    _drop_from_report(gm, names)
    graphed = f": on CUDA, {_graphed_calls()} replay one CUDA graph of both"
    _note_in_report(gm, block, "moe_router", rspec.describe() + "; one uniep.moe_block with the experts it routes to"
                    + graphed)
    _note_in_report(gm, block, "moe_experts", decode_spec(experts.args[8]).describe()
                    + "; one uniep.moe_block with the router" + graphed)
    return True


def _graphed_calls() -> str:
    """Which calls of a marked op take its CUDA graph (op_graphs.worth_a_graph), for the report."""
    from .kernels import op_graphs

    return f"calls of at most {op_graphs.MAX_SLOTS} routed slots and {op_graphs.MAX_GRAPH_FLOP / 1e9:.0f} GFLOP"


def _no_backward_in_report(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """The report's rewrite that added ``node`` (while recording) takes no backward op (Rewrite.needs_grad)."""
    record = gm.meta.get("uniep_record")
    for rewrite in record.rewrites if record is not None else ():
        if not rewrite.graph and node.name in rewrite.added:
            rewrite.needs_grad = False


def _drop_from_report(gm: torch.fx.GraphModule, names: set) -> None:
    """The report's rewrites of the top-level graph no longer name the nodes ``names`` (erased) as added."""
    record = gm.meta.get("uniep_record")
    for rewrite in record.rewrites if record is not None else ():
        if not rewrite.graph:
            rewrite.added = [n for n in rewrite.added if n not in names]


def _may_write(node: torch.fx.Node) -> bool:
    """Whether a node may change a tensor in place, conservatively: a module call, a higher-order op (a user Triton
    kernel, auto_functionalized), a name of an in-place method or function as written (``sigmoid_``,
    ``_foreach_mul_``, ``operator.imul``, ``setitem``), ``inplace=True`` or ``out=``, an op whose schema (any
    overload's, for a packet) mutates an argument, or a callable from outside torch and Python's operators."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"
    target = node.target
    raw = target if isinstance(target, str) else getattr(target, "__name__", "") or ""
    names = (raw.split(".")[-1], op_name(node) or "")
    if any((n.endswith("_") and not n.endswith("__")) or n.strip("_") in IN_PLACE_OPERATORS for n in names) or \
            node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_method":
        return False
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, name)._schema.is_mutable for name in target.overloads())
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    module = getattr(target, "__module__", None) or ""
    return not (module == "_operator" or module.startswith("torch") or module == "builtins")


def _note_in_report(gm: torch.fx.GraphModule, node: torch.fx.Node, op: str, spec: str) -> None:
    """The report's record of the rewrite that added ``node`` (while recording) says ``spec`` from now on."""
    record = gm.meta.get("uniep_record")
    for rewrite in record.rewrites if record is not None else ():
        if rewrite.op == op and not rewrite.graph and node.name in rewrite.added:
            rewrite.spec = spec


def _takes_no_gradient(gm, example_inputs) -> bool:
    """The graph starts with no input needing a gradient (or grad mode off) and never turns grad mode on inside
    (``torch.enable_grad()`` within a no_grad caller: Dynamo puts a _set_grad_enabled node in the graph, and
    AOTAutograd then builds a backward that reads the experts ops' saved outputs)."""
    if _needs_grad(gm, example_inputs):
        return False
    return not any(_is_grad_switch(node) for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                   for node in module.graph.nodes)


def _is_grad_switch(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def _no_grad_nodes(gm, example_inputs) -> set | None:
    """The top-level nodes no backward can reach: all of them (None) where the graph takes no gradient; else, where
    the graph switches grad mode with constants at its top level only (a ``torch.no_grad()`` region, or a function
    decorated with it, compiled and called with grad on), the nodes it runs with grad mode off; else none."""
    if _takes_no_gradient(gm, example_inputs):
        return None
    if any(_is_grad_switch(node) for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
           and module is not gm for node in module.graph.nodes):
        return set()
    found, enabled = set(), torch.is_grad_enabled()
    for node in gm.graph.nodes:
        if _is_grad_switch(node):
            if not (len(node.args) == 1 and isinstance(node.args[0], bool)):
                return set()
            enabled = node.args[0]
        elif not enabled:
            found.add(node)
    return found


def _under_cuda_graphs(opts: UniepOptions, mode: str | None) -> bool:
    """Inductor will run the compiled graph under its CUDA-graph trees (``mode="reduce-overhead"`` or
    ``"max-autotune"``, or the ``triton.cudagraphs`` patch): the op's own graphs (kernels/op_graphs.py) stay out of
    them, since a tree's warm-up runs the model eagerly with every allocation of the thread in the tree's memory
    pool, and an op graph captured then would keep buffers there that the tree hands to other tensors."""
    if opts.inner_backend != "inductor":
        return False
    import torch._inductor
    import torch._inductor.config

    patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    patches.update(opts.inductor)
    return bool(patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))


def _needs_grad(gm, example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in list(example_inputs) + list(gm.parameters()))


def _recording_inner_compile(record, inner_compile):
    """Wrap inductor's inner_compile to count uniep ops in the AOTAutograd forward/backward graphs."""
    def compile_and_count(graph_module, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        record.note_aot_graph(kind, graph_module)
        return inner_compile(graph_module, example_inputs, **kwargs)
    return compile_and_count


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of uniep's own Python sources (the package's .py files, by path and content)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def trace_settings() -> tuple:
    """What uniep reads while AOTAutograd traces, besides the graph, that shapes the compiled graphs: the kernels
    mode, and the late_routing_weight knob (the experts op's autograd formula keeps the down rows for the backward
    or not by it)."""
    from .kernels import config, megakernel

    return megakernel.kernels_mode(), config.late_routing_weight_on(False), config.late_routing_weight_on(True)


@functools.lru_cache(maxsize=1)
def _cache_salt():
    """A post-grad pass that changes nothing and whose uuid is uniep's source hash and its trace_settings. Inductor's
    FX-graph and AOTAutograd caches key on custom passes' uuids, but not on a custom op's fake implementation or its
    autograd formula: without it a graph compiled against another uniep's fake shapes (an op's outputs changed, its
    schema not) would be served from the cache and fail its size asserts, and one traced under other settings would
    keep their saved tensors."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UniepSourceSalt(CustomGraphPass):
        def __call__(self, graph):
            return None

        def uuid(self):
            return ("uniep", source_hash(), *trace_settings())

    return UniepSourceSalt()


def _inner_compile(gm, example_inputs, opts: UniepOptions, mode: str | None):
    inner = opts.inner_backend
    record = gm.meta.get("uniep_record")
    if callable(inner):
        return inner(gm, example_inputs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
        patches.update(opts.inductor)
        if "post_grad_custom_post_pass" not in patches and torch._inductor.config.post_grad_custom_post_pass is None:
            patches["post_grad_custom_post_pass"] = _cache_salt()  # (a user's own pass is left in place)
        if record is None:
            return compile_fx(gm, example_inputs, config_patches=patches or None)
        # Recording: a cache hit would skip inner_compile, and with it the count of uniep ops.
        patches.update(fx_graph_cache=False)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=_recording_inner_compile(record, compile_fx_inner),
                              config_patches=patches)
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager" and record is not None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(kind):
            def compiler(graph_module, _example_inputs):
                record.note_aot_graph(kind, graph_module)
                return make_boxed_func(graph_module.forward)
            return compiler

        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            inference_compiler=keep("inference"))(gm, example_inputs)
    if inner == "tensorrt":
        try:
            import torch_tensorrt  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("uniep: inner_backend='tensorrt' needs torch_tensorrt installed") from exc
        if _needs_grad(gm, example_inputs):
            raise RuntimeError("uniep: inner_backend='tensorrt' is inference only; run under torch.no_grad() "
                               "or use inner_backend='inductor' for training")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


def uniep_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Entry point registered as torch.compile(backend="uniep")."""
    opts = UniepOptions.from_options(options)
    hf_ep.note_compile()
    if not ddp.already_rewritten(gm):  # a DDPOptimizer piece of a graph rewritten whole (ddp.py)
        rewrite_graph(gm, opts, commit=False)
        keep_layers_whole(gm, opts)
        if not _under_cuda_graphs(opts, mode):
            inference = _no_grad_nodes(gm, example_inputs)
            if inference is None or inference:
                mark_inference(gm, inference)
    with capture.compiling(example_inputs):
        compiled = _inner_compile(gm, example_inputs, opts, mode)
    # Counted only now: Dynamo discards a graph whose compile raises and traces the frame again, e.g. under
    # dynamic=True, where AOTAutograd's pass that turns float scalars into tensors raises
    # TensorifyScalarRestartAnalysis to specialize one; the second trace's graph is the one that runs.
    commit_rewrites(gm)
    return compiled


def _configure_logging_from_env():
    """UNIEP_LOG=info (or debug, warning) prints the uniep log to stderr. TORCH_LOGS cannot carry it:
    torch validates TORCH_LOGS names while it is imported, before any backend package can register one."""
    level = os.environ.get("UNIEP_LOG")
    if level and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(level.upper())


def _register_by_name():
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "uniep" not in _BACKENDS:
        register_backend(name="uniep")(uniep_backend)


_register_by_name()
ddp.install()
if os.environ.get("UNIEP_HF_EP", "1") != "0":  # HF's AllToAllEP as one uniep.ep_layer (hf_ep.py); "0": HF's code,
    hf_ep.install()                            # rewritten piece by piece
_configure_logging_from_env()
