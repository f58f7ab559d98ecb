"""Plain PyTorch EP code in one graph with no setting of the user's: the split sizes' host read captured where the
graph broke, and nowhere else.

Plain EP code (examples/ep_moe.py, torchtitan and Megatron style) reads its split sizes on the host with
``.tolist()`` before the token all-to-all. Dynamo breaks the graph there unless
``torch._dynamo.config.capture_scalar_outputs`` is on, so the layer lands in two graphs: the dispatch in the first,
the exchange and the combine in the second, three ops and a host synchronization a layer. Traced as unbacked ints
instead, the sizes keep the layer in one graph, which the backend makes one ``uniep.ep_layer``.

The setting is process-wide, and within a frame it captures every ``.item()`` and ``.tolist()``: an unrelated
``if n:`` on a captured int is then a hard error where it was a graph break (Dynamo guards a SymInt's truth value
without a graph break). So uniep turns it on for one call site only, the one where the graph broke:

1. uniep's backend is handed a graph that ends with a proven EP dispatch whose split sizes leave the graph
   (backend._lower_layers marks it; under DDP, ddp.py checks the same before the split). Dynamo's reason for
   compiling it names where the graph broke (``compile_subgraph_reason.user_stack``): that source line becomes a
   capture site;
2. the running trace's speculation log, where Dynamo recorded that graph break, is cleared (a restart keeps that log,
   so the next trace would break at the same place, captured or not), and Dynamo's own restart of the frame's
   analysis is raised (``TensorifyScalarRestartAnalysis``, the restart Dynamo lets through a backend: AOTAutograd
   raises it the same way). Dynamo drops the graph (uniep counts a graph's rewrites only once it compiled:
   backend.commit_rewrites) and traces the frame from its start again;
3. Dynamo's ``Tensor.tolist()`` and ``Tensor.item()`` handlers, wrapped once (``_install``), trace the call with the
   setting on where the call is at a capture site, of a tensor computed from counts an all-to-all exchanged (a line
   that other code reaches with other tensors, a helper function say, stays a host read for them), and the compile
   is uniep's with ``capture_ep_sizes`` on (the trace's fake mode then allows scalar outputs); every other call, and
   every call of another backend's compile, sees the setting as it is;
4. the inner compile of a graph whose trace captured runs with the setting on (``compiling``).

A site stays a capture site for the process, so a recompile of the frame (another token count) captures it at once.
A site whose graph still broke after it was captured restarts nothing again.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("uniep")

# (file name, line number) of the split-size host reads to trace captured, in uniep's compiles
_SITES: set = set()
_INSTALLED: list = []


def _speculation_log(tx):
    """The trace's speculation log (where it recorded its graph breaks), or None where it has none of the expected
    shape."""
    found = getattr(tx, "speculation_log", None) if tx is not None else None
    return found if callable(getattr(found, "clear", None)) else None


def _current_tx():
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001  (torch internals other than expected: nothing to do)
        return None


def _is_all_to_all(node) -> bool:
    return node.op == "call_function" and "all_to_all" in str(getattr(node.target, "__name__", node.target))


def _from_an_all_to_all(node, limit: int = 256) -> bool:
    """Whether the graph node ``node`` is computed from counts an all-to-all exchanged: one of the nodes it is computed
    from is an all-to-all, is handed to one (the counts sent), or is written in place from what one returned
    (``dist.all_to_all_single(recv, send)`` traces as the functional collective copied into ``recv``). Bounded."""
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_all_to_all(n):
            return True
        for user in n.users:
            if _is_all_to_all(user):
                return True
            in_place = str(getattr(user.target, "__name__", user.target)).removesuffix(".default").endswith("_")
            if in_place and user.args and user.args[0] is n:
                todo.extend(user.all_input_nodes)  # an in-place write into n: what it wrote is n's value
        todo.extend(n.all_input_nodes)
    return False


def _capturing(tx, tensor) -> bool:
    """Whether the read of ``tensor`` the trace ``tx`` is at is at a capture site, of counts an all-to-all exchanged
    (a site is a source line, which other code may reach with other tensors: those stay host reads), in a uniep
    compile with capture_ep_sizes on."""
    try:
        site = (tx.f_code.co_filename, tx.lineno)
        if site not in _SITES or not _from_an_all_to_all(tensor.as_proxy().node):
            return False
        from .backend import UniepOptions
        from .hf_ep import _uniep_options

        call = _uniep_options(tx.output.compiler_fn)
        return call is not None and UniepOptions.from_options(call[1]).capture_ep_sizes
    except Exception:  # noqa: BLE001  (torch internals other than expected: trace as Dynamo would)
        return False


def _install() -> bool:
    """Wrap Dynamo's handlers of Tensor.tolist() and Tensor.item() once (step 3 of the module docstring). Returns
    whether they are wrapped."""
    if _INSTALLED:
        return True
    try:
        import dataclasses

        from torch._dynamo.variables.tensor import TensorVariable

        # torch 2.14 dispatches through a table of the handlers (tp_methods), torch 2.11 by the method's name
        table = getattr(TensorVariable, "tp_methods", None)
        names = ("tolist", "item")
        if isinstance(table, dict) and all(dataclasses.is_dataclass(table.get(n)) for n in names):
            originals = {n: table[n].handler for n in names}

            def put(n, handler):
                table[n] = dataclasses.replace(table[n], handler=handler)
        else:
            originals = {n: getattr(TensorVariable, f"method_{n}") for n in names}

            def put(n, handler):
                setattr(TensorVariable, f"method_{n}", handler)
    except Exception:  # noqa: BLE001  (no such handlers in this torch: no capture)
        return False

    def wrap(original):
        @functools.wraps(original)
        def method(self, tx, *args, **kwargs):
            fake_mode = getattr(getattr(tx, "output", None), "fake_mode", None)
            if torch._dynamo.config.capture_scalar_outputs or fake_mode is None or not _capturing(tx, self):
                return original(self, tx, *args, **kwargs)
            # the setting as Dynamo reads it here, and as the trace's fake mode reads it (its shape environment took
            # the setting when the trace began): the item() reads of this call become unbacked ints. The fake mode
            # keeps it for the rest of this compile (it is this trace's own): AOTAutograd traces the graph again in
            # it, item() reads included where they stay in the graph
            fake_mode.allow_scalar_outputs = True
            tx.output.uniep_captured = True  # the inner compile of its graphs runs with the setting on (compiling)
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                return original(self, tx, *args, **kwargs)
        return method

    for name, original in originals.items():
        put(name, wrap(original))
    _INSTALLED.append(True)
    return True


def trace_again_capturing_sizes(gm) -> None:
    """Have Dynamo trace the frame being compiled again with the host read where ``gm``'s graph broke captured (the
    module docstring). Returns without doing anything where the setting is on already (the trace captured
    everything), where the graph broke at something other than a host read of a tensor's value, where that site was
    captured already and the graph still broke there, where no Dynamo trace is running (the backend called
    directly), or where this torch lacks what it needs; the graph then compiles as it is, two graphs as before."""
    if torch._dynamo.config.capture_scalar_outputs:
        return
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None) if getattr(reason, "graph_break", False) else None
    restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    breaks = _speculation_log(_current_tx())
    # the graph broke at a host read of a tensor's value (Dynamo's "data dependent operator", the .tolist() or .item()
    # of the sizes), not at another break after them (a branch on a captured size, say)
    if not stack or restart is None or breaks is None or "_local_scalar_dense" not in str(reason.reason):
        return
    site = (stack[-1].filename, stack[-1].lineno)
    if site in _SITES or not _install():
        return
    _SITES.add(site)
    breaks.clear()
    log.info("uniep: a graph ends with an EP dispatch whose split sizes go to the host (%s:%d): Dynamo traces the "
             "frame again with that read captured, so that the layer is one graph (capture_ep_sizes=False leaves "
             "the two graphs)", *site)
    raise restart(restart_reason="uniep: the EP layer's split sizes captured (capture_ep_sizes)")


def compiling(example_inputs):
    """A context for the inner compile of a graph: where the trace that made the graph captured a split-size read,
    capture_scalar_outputs on, and the fake mode of the graph's inputs allowed scalar outputs (Dynamo hands the
    backend inputs of a fake mode of their own, made from the trace's settings; AOTAutograd runs the graph's item()
    reads again in it). Elsewhere nothing."""
    import contextlib

    tx = _current_tx()
    if not getattr(getattr(tx, "output", None), "uniep_captured", False) or \
            torch._dynamo.config.capture_scalar_outputs:
        return contextlib.nullcontext()
    try:
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
    except Exception:  # noqa: BLE001  (torch internals other than expected)
        fake_mode = None
    if fake_mode is not None:
        fake_mode.allow_scalar_outputs = True  # this graph's own fake mode
    return torch._dynamo.config.patch(capture_scalar_outputs=True)
