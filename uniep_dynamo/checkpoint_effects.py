"""Activation-checkpoint bodies with Python side effects, traced in uniep's compiles.

Dynamo refuses a write to an object from outside a ``torch.utils.checkpoint`` body (eager checkpointing runs the
body again in the backward's recompute, side effects and all, which a graph cannot): it breaks the graph there, and
the checkpoint then runs eagerly, out of every backend's reach (``torch.utils.checkpoint`` is excluded from
Dynamo). Since transformers 5.25 every HF decoder layer writes so: the ``kernels`` package's hub wrapper around the
attention's forward sets and resets a context variable (``CompileableContextVar``, a plain attribute while
compiling); HF's output capture hooks append to the step's list (``output_router_logits=True``,
``output_hidden_states=True``) in every version. A model trained with gradient checkpointing then has no MoE layer
in any graph: uniep, and inductor, compile nothing inside its layers, and no graph says so.

torch's own setting for it, ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``, traces such a
body with its side effects applied once, in the forward, and not again in the backward's recompute (accelerate turns
it on for compiled FSDP2 with activation checkpointing, as torchtitan does). The setting is process-wide. uniep turns
it on for its own compiles only: Dynamo's checkpoint handler (``CheckpointHigherOrderVariable._call_function``) is
wrapped once, at import, so that a checkpoint traced in a uniep compile with ``trace_checkpoint_side_effects`` on
(the default) takes side effects; every other compile, another backend's, sees the setting as it is.

What differs from eager checkpointing: a side effect of the body runs once a step instead of twice (the forward and
the recompute). HF's are of the kind for which once is right: a context variable set and reset around one call, a
list the step's outputs are read from (eager's recompute appends the router logits a second time, after the step
read them). ``trace_checkpoint_side_effects=False`` keeps Dynamo's graph break for a body whose side effect must run
again in the backward (unless torch's own setting is on, which then decides). A checkpoint inside the body of another
higher-order op (a nested_compile_region, a torch.cond branch) keeps the break too: torch mishandles side effects
there (``_takes_side_effects``). A side effect Dynamo guards on (an int counter the body increments) recompiles the
frame each step, as it would outside a checkpoint.

Where Dynamo cannot trace a checkpoint in a uniep compile (that option off, a host read inside the body, a hook that
breaks the graph), uniep warns once per call site that the checkpoint runs eagerly and nothing inside it is fused:
without it the missing rewrites would be silent, since the layers are in no graph the report sees.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("uniep")

_INSTALLED: list = []
_LOGGED: set = set()


def _uniep_call(tx):
    """(mode, options) of the uniep compile the trace ``tx`` is, or None (another backend's, or torch internals
    other than expected)."""
    try:
        from .hf_ep import _uniep_options

        return _uniep_options(tx.output.compiler_fn)
    except Exception:  # noqa: BLE001
        return None


def _takes_side_effects(tx, call, checkpoint_op) -> bool:
    """Whether the checkpoint ``checkpoint_op`` that the trace ``tx`` of the uniep compile ``call`` (mode, options) is
    at takes side effects: trace_checkpoint_side_effects on, and the checkpoint in no body of another higher-order op
    (at the top of the frame, or in checkpoints only). Inside a nested_compile_region's body (traced once, called many
    times) or a torch.cond branch, torch's handling of such a checkpoint applies the side effect fewer times than
    eager, or its compile fails (measured on torch 2.13 with torch's own setting alike), so there Dynamo's graph break
    stays."""
    from .backend import UniepOptions

    try:
        if not UniepOptions.from_options(call[1]).trace_checkpoint_side_effects:
            return False
    except ValueError as exc:  # the backend raises it for the first graph; a frame with no other graph would not
        _say_once(("options", str(exc)), logging.WARNING, "%s", exc)
        return False
    tracer = getattr(getattr(tx, "output", None), "current_tracer", None)
    while getattr(tracer, "parent", None) is not None:  # a subgraph's tracer: inside a higher-order op's body
        if getattr(tracer, "source_target", None) is not checkpoint_op:
            return False
        tracer = tracer.parent
    return True


# what Dynamo raises where it cannot trace a checkpoint's body and breaks the graph before it
_BREAKS = tuple(cls for cls in (getattr(torch._dynamo.exc, "Unsupported", None),
                                getattr(torch._dynamo.exc, "UncapturedHigherOrderOpError", None)) if cls is not None)


def _say_once(key, level: int, message: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.log(level, message, *args)


def _site(tx) -> str:
    code = getattr(tx, "f_code", None)
    return f"{getattr(code, 'co_filename', '?')}:{getattr(tx, 'lineno', '?')}"


def install() -> bool:
    """Wrap Dynamo's checkpoint handler once (the module docstring). Returns whether it is wrapped: False where this
    torch has no such handler, and checkpoint bodies with side effects then break the graph as Dynamo makes them."""
    if _INSTALLED:
        return True
    try:
        from torch._dynamo.variables.higher_order_ops import CheckpointHigherOrderVariable

        original = CheckpointHigherOrderVariable._call_function
    except (ImportError, AttributeError):
        return False

    @functools.wraps(original)
    def _call_function(self, tx, *args, **kwargs):
        call = _uniep_call(tx)
        if call is None:  # another backend's compile
            return original(self, tx, *args, **kwargs)
        site = _site(tx)
        checkpoint_op = getattr(self, "value", None)
        if not getattr(self, "allow_side_effects", True) and _takes_side_effects(tx, call, checkpoint_op):
            self.allow_side_effects = True  # a handler of this trace, a uniep compile's
            _say_once(("traced", site), logging.INFO,
                      "uniep: the activation checkpoint at %s is traced with its side effects applied once, in the "
                      "forward, not again in the backward's recompute (trace_checkpoint_side_effects=False keeps "
                      "Dynamo's graph break there)", site)
        try:
            return original(self, tx, *args, **kwargs)
        except _BREAKS as exc:  # Dynamo breaks the graph here: the checkpoint runs eagerly
            if not (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False)):  # else it raises
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                _say_once(("eager", site), logging.WARNING,
                          "uniep: Dynamo cannot trace the activation checkpoint at %s (%s): it runs eagerly, and no "
                          "MoE layer inside it is fused", site, reason)
            raise

    CheckpointHigherOrderVariable._call_function = _call_function
    _INSTALLED.append(original)
    return True
