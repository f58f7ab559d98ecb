"""Plain PyTorch EP code in one graph with no setting of the user's: the frame traced again with the split sizes
captured.

Plain EP code (examples/ep_moe.py, torchtitan and Megatron style) reads its split sizes on the host with
``.tolist()`` before the token all-to-all. Dynamo breaks the graph there unless
``torch._dynamo.config.capture_scalar_outputs`` is on, so the layer lands in two graphs: the dispatch in the first,
the exchange and the combine in the second, three ops and a host synchronization a layer. With the setting on, the
sizes are traced as unbacked ints, the layer is one graph, and the backend makes it one ``uniep.ep_layer``.

The setting is process-wide and changes how Dynamo traces every function under any backend, so uniep does not set it
for the process. It turns it on for one compile: when uniep's backend is handed a graph that ends with a proven EP
dispatch whose split sizes leave the graph (backend._lower_layers marks it), it turns the setting on and raises
Dynamo's own restart of the frame's analysis (``TensorifyScalarRestartAnalysis``, the restart Dynamo lets through a
backend: AOTAutograd raises it the same way). Dynamo drops the graph (uniep counts a graph's rewrites only once it
compiled: backend.commit_rewrites) and traces the frame from its start again, now capturing the sizes. When that
compile ends (Dynamo's compile-end callback, run once the outermost compile is over, whether it succeeded or raised)
the setting is put back as it was. Another compile of the frame (a recompile for a new token count) goes the same
way. Dynamo does not guard a compiled frame on its settings (torch 2.11 to 2.14), so the frame's code runs after the
setting is put back.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("uniep")

# the setting's value before uniep turned it on, while a compile runs with it on; empty otherwise
_RESTORE: list = []


def _restore(_args=None) -> None:
    if _RESTORE:
        torch._dynamo.config.capture_scalar_outputs = _RESTORE.pop()


def _callbacks():
    """Dynamo's compilation callback handler, or None where this torch has none of the expected shape."""
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is None or not isinstance(getattr(handler, "end_callbacks", None), list):
        return None
    return handler


def _speculation_log():
    """The speculation log of the Dynamo trace running now (where it recorded its graph breaks), or None where no
    trace runs or this torch has none of the expected shape."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001  (torch internals other than expected: no restart)
        return None
    found = getattr(tx, "speculation_log", None) if tx is not None else None
    return found if callable(getattr(found, "clear", None)) else None


def trace_again_capturing_scalars() -> None:
    """Have Dynamo trace the frame being compiled again with capture_scalar_outputs on, for this compile only (the
    module docstring). Returns without doing anything where the setting is on already (the trace that is running
    captured them: nothing to gain, and no second restart), where no Dynamo trace is running (the backend called
    directly), or where this torch lacks the restart, the callback or the trace's log of graph breaks it needs; the
    graph then compiles as it is, two graphs as before."""
    if torch._dynamo.config.capture_scalar_outputs or _RESTORE:
        return
    restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    handler, log_of_breaks = _callbacks(), _speculation_log()
    if restart is None or handler is None or log_of_breaks is None:
        return
    # the trace's record of where it broke the graph, which a restart keeps (so the next trace would break at the
    # .tolist() again, captured or not): forgotten, so that the next trace finds its graph breaks anew
    log_of_breaks.clear()
    # registered again where needed: torch._dynamo.reset() clears the registered callbacks
    if _restore not in handler.end_callbacks:
        handler.register_end_callback(_restore)
    _RESTORE.append(torch._dynamo.config.capture_scalar_outputs)
    torch._dynamo.config.capture_scalar_outputs = True
    log.info("uniep: a graph ends with an EP dispatch whose split sizes go to the host: Dynamo traces the frame "
             "again with capture_scalar_outputs on for this compile, so that the layer is one graph "
             "(capture_ep_sizes=False leaves the two graphs)")
    raise restart(restart_reason="uniep: the EP layer's split sizes captured (capture_ep_sizes)")
