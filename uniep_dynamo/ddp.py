"""DDP: keep every proven MoE region in one piece when Dynamo's DDPOptimizer splits a graph at DDP's buckets.

Why this wraps a torch internal. Under DDP, whether the user wrote ``torch.compile(DDP(model))`` or
``DDP(torch.compile(model))``, Dynamo compiles the model's frames inside ``DDP.forward`` (which sets
``DistributedDataParallel._active_ddp_module``). With ``torch._dynamo.config.optimize_ddp`` at its default
(True, i.e. "ddp_optimizer"), ``convert_frame`` then hands the frame's graph to
``torch._dynamo.backends.distributed.DDPOptimizer(...).compile_fn`` instead of to the backend. ``compile_fn``
walks the graph backwards, cuts it each time the parameters it has seen fill a bucket (``bucket_cap_mb``,
25 MiB by default; the first bucket 1 MiB), ``split_module``s it and calls the backend once per piece
(``SubmodCompiler.compile_submod``). A cut can fall between an experts region's up and down GEMMs (one expert
weight of a real model is larger than a bucket), so neither piece holds the region and uniep declined it.
No public hook runs before that split.

So ``install()`` wraps ``DDPOptimizer.compile_fn``: when the backend it will call is uniep, the whole graph is
rewritten first (each proven region becomes one op node, which a split cannot cut; DDPOptimizer counts the
node's weight arguments into its bucket like any other call), then the original ``compile_fn`` splits and
compiles as before, and each piece goes to uniep marked as already rewritten (``already_rewritten``), so it
is not matched again. Any other backend is left alone. If the torch internals are not as expected (the class
or method is gone, the instance has no ``backend_compile_fn``), one message is logged and DDPOptimizer runs
unwrapped: the pieces are then matched on their own and a region cut in two is declined with the reason
"split across DDP buckets" (patterns/split.py).

FSDP2 (``fully_shard``) needs nothing here: it does not split Dynamo graphs; its hooks run outside them.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("uniep")

_REWRITTEN = "uniep_rewritten_before_ddp_split"  # gm.meta key on DDPOptimizer's pieces of a rewritten graph
_installed = False


def already_rewritten(gm) -> bool:
    """Whether `gm` is one of DDPOptimizer's pieces of a graph uniep rewrote whole before the split."""
    return bool(getattr(gm, "meta", {}).get(_REWRITTEN))


def _uniep_call(compile_fn):
    """(mode, options) if `compile_fn` is the uniep backend behind Dynamo's wrappers, else None.

    Dynamo's chain is WrapBackendDebug (``__wrapped__``) -> torch's _TorchCompileWrapper (``compiler_fn``, with
    ``kwargs`` {"mode", "options"}) -> uniep_backend; a user may also pass uniep_backend or a
    functools.partial of it directly."""
    from .backend import uniep_backend

    kwargs: dict = {}
    seen = 0
    while compile_fn is not None and seen < 16:
        seen += 1
        if compile_fn is uniep_backend:
            return kwargs.get("mode"), kwargs.get("options")
        if isinstance(compile_fn, functools.partial):
            kwargs = {**compile_fn.keywords, **kwargs}
            compile_fn = compile_fn.func
            continue
        wrapper_kwargs = getattr(compile_fn, "kwargs", None)
        if isinstance(wrapper_kwargs, dict):
            kwargs = {**wrapper_kwargs, **kwargs}
        compile_fn = getattr(compile_fn, "__wrapped__", None) or getattr(compile_fn, "compiler_fn", None)
    return None


def _mark_pieces(backend_compile_fn):
    def compile_piece(piece, example_inputs, *args, **kwargs):
        piece.meta[_REWRITTEN] = True
        return backend_compile_fn(piece, example_inputs, *args, **kwargs)
    return compile_piece


def _wrap(original_compile_fn):
    @functools.wraps(original_compile_fn)
    def compile_fn(self, gm, example_inputs, *args, **kwargs):
        backend_compile_fn = getattr(self, "backend_compile_fn", None)
        call = _uniep_call(backend_compile_fn)
        if call is None:
            return original_compile_fn(self, gm, example_inputs, *args, **kwargs)
        from .backend import UniepOptions, commit_rewrites, keep_layers_whole, rewrite_graph

        opts = UniepOptions.from_options(call[1])
        rewrite_graph(gm, opts, commit=False)
        keep_layers_whole(gm, opts)  # as uniep_backend does
        self.backend_compile_fn = _mark_pieces(backend_compile_fn)
        try:
            compiled = original_compile_fn(self, gm, example_inputs, *args, **kwargs)
        finally:
            self.backend_compile_fn = backend_compile_fn
        # counted once the pieces compiled (a compile Dynamo discards counts nothing; the pieces share gm's meta,
        # so the first piece's backend call may have counted them already, and this finds nothing left)
        commit_rewrites(gm)
        return compiled
    compile_fn._uniep_wrapped = True
    return compile_fn


def install() -> bool:
    """Wrap DDPOptimizer.compile_fn once per process. Returns whether the wrapper is in place."""
    global _installed
    if _installed:
        return True
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer

        original = DDPOptimizer.compile_fn
        probe = DDPOptimizer.__new__(DDPOptimizer)
        DDPOptimizer.__init__(probe, bucket_bytes_cap=2**30, backend_compile_fn=_install_probe)
        if getattr(probe, "backend_compile_fn", None) is not _install_probe:
            raise AttributeError("DDPOptimizer keeps its backend elsewhere than backend_compile_fn")
    except Exception as exc:  # noqa: BLE001  (any change of the torch internal: degrade, never crash)
        log.warning("uniep: cannot wrap torch's DDPOptimizer (%s: %s); under DDP with optimize_ddp, a MoE region "
                    "that a bucket boundary cuts runs unfused", type(exc).__name__, exc)
        return False
    if not getattr(original, "_uniep_wrapped", False):
        DDPOptimizer.compile_fn = _wrap(original)
    _installed = True
    return True


def _install_probe(gm, example_inputs):  # the backend of install()'s probe instance; never called
    raise AssertionError("uniep: the DDPOptimizer probe compiled a graph")
