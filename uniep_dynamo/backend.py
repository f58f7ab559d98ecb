"""The torch.compile backend: rewrite MoE regions, then hand the graph to the inner backend.

    torch.compile(model, backend="uniep")                                   # inductor behind us
    torch.compile(model, backend="uniep", options={"inner_backend": "eager"})

Options (``options={...}``): see ``UniepOptions``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields

import torch
from torch._dynamo.utils import counters

from .lowering import lower_experts
from .patterns import find_experts_regions

log = logging.getLogger("uniep")

INNER_BACKENDS = ("inductor", "eager", "aot_eager", "tensorrt")


@dataclass(frozen=True)
class UniepOptions:
    inner_backend: object = "inductor"  # a name from INNER_BACKENDS, or any torch.compile backend callable
    rewrite_experts: bool = True  # False: leave the graph as Dynamo made it (for A/B comparisons)
    inductor: dict = field(default_factory=dict)  # inductor config patches, as torch.compile(options=...) takes

    @classmethod
    def from_options(cls, options: dict | None) -> "UniepOptions":
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"uniep: unknown option(s) {unknown}; known options are {sorted(known)}")
        opts = cls(**options)
        if isinstance(opts.inner_backend, str) and opts.inner_backend not in INNER_BACKENDS:
            raise ValueError(f"uniep: inner_backend {opts.inner_backend!r} is not one of {INNER_BACKENDS} "
                             "(or pass a backend callable)")
        return opts


def rewrite_graph(gm: torch.fx.GraphModule, opts: UniepOptions | None = None):
    """Rewrite every proven experts region of `gm` in place. Returns (matches, near_misses)."""
    opts = opts or UniepOptions()
    if not opts.rewrite_experts:
        return [], []
    matches, misses = find_experts_regions(gm.graph)
    for match in matches:
        lower_experts(gm, match)
        counters["uniep"]["moe_experts"] += 1
        log.info("uniep: rewrote %s (%s spelling, %d nodes) into uniep.moe_experts [%s]",
                 match.module, match.spelling, len(match.nodes), match.spec.describe())
    for miss in misses:
        counters["uniep"]["unfused"] += 1
        log.warning("uniep: %s runs unfused: %s", miss.module, miss.reason)
    if matches:
        # No graph-wide eliminate_dead_code here: Dynamo graphs hold in-place ops without users
        # (scatter_ into a mask, say) that FX's DCE would drop. The lowering erased its own region.
        gm.graph.lint()
        gm.recompile()
    return matches, misses


def _needs_grad(gm, example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in list(example_inputs) + list(gm.parameters()))


def _inner_compile(gm, example_inputs, opts: UniepOptions, mode: str | None):
    inner = opts.inner_backend
    if callable(inner):
        return inner(gm, example_inputs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
        patches.update(opts.inductor)
        return compile_fx(gm, example_inputs, config_patches=patches or None)
    if inner == "eager":
        return gm.forward
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
    rewrite_graph(gm, opts)
    return _inner_compile(gm, example_inputs, opts, mode)


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
_configure_logging_from_env()
