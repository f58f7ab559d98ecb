"""HF transformers' expert parallelism through the compiler: under ``torch.compile(model, backend="uniep")`` each
call of ``AllToAllEP`` (transformers >= 5.23, ``DistributedConfig(ep_size=N)``) is traced as ONE
``torch.ops.uniep.ep_layer`` (ep/layer.py), and its backward is one ``uniep.ep_layer_backward``.

Why a substitution. Traced as written, the layer cannot sit in one Dynamo graph: the split sizes go to the host
(``.tolist()``) and the experts call sits behind ``if tokens.shape[0] == 0``, a branch on a data-dependent size.
So Dynamo makes two graphs of it and the graph rewrite (patterns/ep.py) can only fuse each side. Here the layer
never reaches Dynamo as code: Dynamo sees one opaque op call, whose implementation is uniep's EP layer.

How. ``install()`` runs when the backend module is imported, which ``torch.compile(backend="uniep")`` does through
the ``torch_dynamo_backends`` entry point before it traces anything (or, if transformers' EP module is imported
later, right after that import). It replaces ``AllToAllEP.__call__`` by a function that outside a Dynamo trace is
HF's own call. Inside a trace it asks ``_layer_plan()``, which Dynamo runs at trace time
(``torch._dynamo.assume_constant_result``: the answer is baked into the traced code) and which

1. finds the backend of the compile being traced: the root tracer's ``OutputGraph.compiler_fn``, unwrapped as
   ddp.py does. Not uniep: the call is traced as HF wrote it, so every other backend in the process sees HF's
   code, unchanged (Dynamo keeps its compiled code per backend, so uniep's never serves another backend);
2. proves the layer, else declines with a reason in the ``uniep`` log (the layer is then traced as HF wrote it,
   and the piece-by-piece rewrite applies): the ``AllToAllEP`` methods are a version uniep was checked against
   (their source text, blank and comment lines aside, hashed), not overridden by a subclass; no tensor parallelism
   beside EP; no autocast; the experts forward is the class's own; and the experts computation is one the experts
   pattern proves: the experts forward, called as ``AllToAllEP`` calls it (top-1, weight 1), is captured by a
   nested Dynamo trace of its own and matched by patterns/experts.py, which yields the op's spec (gate, layout,
   biases) and which parameters are the weights, and the forward returns that computation itself: after the
   proven region only a cast to the dtype it has, a reshape back to [T, H] or a copy (``_require_returns_root``;
   ``2 * experts(...)`` declines), and changes nothing else (no attribute, buffer, container or input changed:
   ep_layer never runs the forward, so such a side effect would be lost). The traced code re-reads the experts'
   attributes the spec depends on, so Dynamo guards them, after a decline too (so a declined entry stops serving
   once the experts change).

transformers 5.17's sentinel-mask EP has no ``AllToAllEP``: nothing is installed, and the graph rewrite handles it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import sys
import textwrap
import types

import torch

log = logging.getLogger("uniep")

_HF_MODULE = "transformers.distributed.expert_parallel"
# Source hashes (source_hash) of AllToAllEP.__call__, _dispatch_tokens and _combine_tokens that uniep.ep_layer
# was checked against: what it computes is what these compute. 5.23 and 5.24 hash alike: their
# distributed/expert_parallel.py, distributed/configuration_utils.py (DistributedConfig) and integrations/moe.py (the
# experts classes' attributes _signature reads) are byte for byte the same; tests/test_ep_compile.py passes on both.
KNOWN_SOURCES = {
    "b4c1844cdd90": "transformers 5.23 to 5.25",
}
_installed = False
_PROBES: dict = {}  # experts signature -> (spec text, parameter names) or a decline reason (str)
_WARNED: set = set()
_COMPILING: list = []  # not empty once uniep's backend has compiled a graph in this process (note_compile)
EAGER_WARNING = ("uniep: HF's expert-parallel layer (transformers' AllToAllEP) ran eagerly in a process where uniep "
                 "compiles graphs: Dynamo did not trace it, so it is not one uniep.ep_layer. Known causes: "
                 "generate() called on torch.compile(model)'s wrapper runs the uncompiled model (compile in place "
                 "instead: model.compile(backend=\"uniep\")); under activation checkpointing with HF's EP, FSDP2's "
                 "hook on the experts module breaks the graph inside the checkpoint and Dynamo runs the decoder "
                 "layers eagerly (compile the MoE blocks instead: `for layer in model.model.layers: "
                 "layer.mlp.compile(backend=\"uniep\")`). Said once; a model meant to run eagerly here needs nothing.")


def note_compile() -> None:
    """uniep's backend compiled a graph: from now on HF's EP layer running eagerly is worth one warning (a compile
    that silently leaves the layers to eager, as under activation checkpointing, says so)."""
    if not _COMPILING:
        _COMPILING.append(True)


class _Decline(Exception):
    pass


@functools.lru_cache(maxsize=4)
def source_hash(cls) -> str:
    """A hash of the source text of cls.__call__ (HF's, under the substitution), _dispatch_tokens and _combine_tokens:
    dedented, blank and whole-line comment lines dropped, trailing spaces stripped. Text, not the AST: ``ast.dump``
    differs between Python versions (3.12 added fields), so an AST hash taken on one Python declined the same
    transformers on another. A docstring or inline comment change declines too, which errs on the safe side."""
    digest = hashlib.sha256()
    for name in ("__call__", "_dispatch_tokens", "_combine_tokens"):
        fn = getattr(cls, name)
        fn = getattr(fn, "_uniep_original", fn)
        lines = (line.rstrip() for line in textwrap.dedent(inspect.getsource(fn)).splitlines())
        digest.update("\n".join(line for line in lines if line and not line.lstrip().startswith("#")).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:12]


# ---- installing the substitution ---------------------------------------------------------------------------------

def install() -> bool:
    """Replace AllToAllEP.__call__ once per process, now if transformers' EP module is loaded, else when it is.
    Returns whether the substitution is in place."""
    module = sys.modules.get(_HF_MODULE)
    if module is None:
        if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
        return False
    return _patch(module)


def _patch(module) -> bool:
    global _installed
    cls = getattr(module, "AllToAllEP", None)
    if cls is None:  # transformers before 5.23: sentinel-mask EP, rewritten piece by piece
        return False
    original = cls.__dict__.get("__call__")
    if original is None or getattr(original, "_uniep_substitute", False):
        _installed = original is not None
        return _installed

    @functools.wraps(original)
    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if torch.compiler.is_compiling():
            plan = _layer_plan()
            if plan is not None:
                # the signature is read and compared in the trace, after a decline too (plan = (signature,)): Dynamo
                # guards what the proof rests on, so switching the experts' implementation retraces either way
                experts = self.experts_forward.__self__
                if _same(_signature(experts), plan[0]) and len(plan) > 1:
                    _, spec, group_name, world, overlap, knobs, device_plan, names = plan
                    w_up, w_down, b_up, b_down = (None if n is None else getattr(experts, n) for n in names)
                    return torch.ops.uniep.ep_layer(hidden_states, top_k_index, top_k_weights, w_up, w_down, b_up,
                                                    b_down, spec, group_name, world, overlap, knobs, device_plan)[0]
        elif _COMPILING and "eager" not in _WARNED:
            _WARNED.add("eager")
            log.warning(EAGER_WARNING)
        return original(self, hidden_states, top_k_index, top_k_weights)

    __call__._uniep_substitute = True
    __call__._uniep_original = original
    cls.__call__ = __call__
    _installed = True
    return True


class _PatchOnImport:
    """A meta-path finder that patches transformers' EP module right after it is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _HF_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _patch(module)
        loader.exec_module = exec_and_patch
        return spec


# ---- the trace-time decision -------------------------------------------------------------------------------------

def _signature(experts) -> tuple:
    """The experts' attributes the probed spec rests on (read in the trace too, so Dynamo guards them): plain
    strings, bools and ints, the class by its module and qualified name, and the training flag (a forward may do
    other things in training)."""
    cls = type(experts)
    return (cls.__module__, cls.__qualname__, experts.config._experts_implementation, experts.has_gate,
            experts.has_bias, experts.is_transposed, experts.is_concatenated, experts.has_post_expert_norm,
            experts.num_experts, experts.training)


def _same(current: tuple, probed: tuple) -> bool:
    """current == probed, one constant at a time: torch 2.11's Dynamo failed on the tuples' ``==`` (its polyfill
    made a guard on a source that cannot have one: InternalTorchDynamoError), where it folds constants' ``!=``."""
    if len(current) != len(probed):
        return False
    for a, b in zip(current, probed):
        if a != b:
            return False
    return True


def _warn(where: str, reason: str) -> None:
    if (where, reason) not in _WARNED:
        _WARNED.add((where, reason))
        log.warning("uniep: HF's expert-parallel layer %s runs as HF wrote it (its dispatch and combine are "
                    "rewritten piece by piece): %s", where, reason)


@torch._dynamo.assume_constant_result
def _layer_plan():
    """(signature, spec, group name, world, overlap, knobs, weight names) of the traced AllToAllEP call for
    uniep.ep_layer; (signature,) for a decline (logged) of a layer whose experts have one (the trace compares it, so
    Dynamo guards it: the declined entry does not serve once the experts change); None otherwise (not uniep's
    compile, or nothing to guard). Runs at trace time."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx()
        call = _uniep_options(root.output.compiler_fn)
        if call is None:
            return None
        traced = root.output.current_tx.symbolic_locals
        ep = traced["self"].value
        hidden = traced["hidden_states"].as_proxy().node.meta["example_value"]
        weights = traced["top_k_weights"].as_proxy().node.meta["example_value"]
        ids = traced["top_k_index"].as_proxy().node.meta["example_value"]
    except Exception as exc:  # noqa: BLE001  (torch internals other than expected: degrade, never crash)
        _warn("", f"uniep cannot read the traced call ({type(exc).__name__}: {exc})")
        return None
    from .backend import UniepOptions

    opts = UniepOptions.from_options(call[1])
    where = type(ep).__name__
    if not opts.rewrite_ep:
        return None
    try:
        plan = _prove(ep, hidden, ids, weights)
    except _Decline as exc:
        _warn(where, str(exc))
        return _declined(ep)
    except Exception as exc:  # noqa: BLE001  (a proof that cannot run declines; the trace goes on as HF wrote it)
        _warn(where, f"uniep could not check the layer ({type(exc).__name__}: {exc})")
        return _declined(ep)
    signature, spec, names = plan
    # the sequential exchange's backward reuses the experts' saved buffers under the compile's reuse_saved_buffers,
    # as the experts op's own backward does (the same bits; a second backward then raises, naming the option)
    from .spec import decode_spec

    spec = dataclasses.replace(decode_spec(spec), reuse_saved=opts.reuse_saved_buffers).encode()
    group = ep.ep_mesh.get_group()
    knobs = json.dumps(opts.ep_knobs, sort_keys=True) if opts.ep_knobs else ""
    log.info("uniep: HF's %s traced as uniep.ep_layer over %d ranks [%s]", where, ep.ep_mesh.size(), spec)
    from .ep.device_choice import mode

    return (signature, spec, group.group_name, ep.ep_mesh.size(), opts.overlap_ep, knobs, mode(opts.ep_device_plan),
            names)


def _declined(ep):
    """(signature,) of a declined layer's experts, for the trace to compare, or None where they have none."""
    try:
        return (_signature(ep.experts_forward.__self__),)
    except Exception:  # noqa: BLE001  (no experts module or attributes of its own: nothing to guard; never crash)
        return None


def _uniep_options(compiler_fn):
    from .ddp import _uniep_call

    seen = 0
    while compiler_fn is not None and seen < 4:  # under DDP, Dynamo's backend is DDPOptimizer.compile_fn
        seen += 1
        call = _uniep_call(compiler_fn)
        if call is not None:
            return call
        compiler_fn = getattr(getattr(compiler_fn, "__self__", None), "backend_compile_fn", None)
    return None


def _prove(ep, hidden, ids, weights):
    """(signature, spec text, weight parameter names) of an AllToAllEP call uniep.ep_layer computes, or _Decline."""
    module = sys.modules[_HF_MODULE]
    cls = module.AllToAllEP
    for name in ("_dispatch_tokens", "_combine_tokens"):
        if getattr(type(ep), name) is not getattr(cls, name):
            raise _Decline(f"{type(ep).__name__} overrides AllToAllEP.{name}")
    digest = source_hash(cls)
    if digest not in KNOWN_SOURCES:
        raise _Decline(f"AllToAllEP's code (hash {digest}) is not a version uniep was checked against "
                       f"({', '.join(KNOWN_SOURCES.values())})")
    if ep.tp_mesh.size() != 1:
        raise _Decline("tensor parallelism beside expert parallelism (tp_size > 1) is not taken yet")
    for device_type in {hidden.device.type, "cpu"}:
        if torch.is_autocast_enabled(device_type):
            raise _Decline("the layer runs under autocast")
    if ids.dtype != torch.int64 or ids.dim() != 2 or hidden.dim() != 2:
        raise _Decline(f"top_k_index is {ids.dtype} {list(ids.shape)}, hidden states {list(hidden.shape)}")
    if weights.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise _Decline(f"routing weights are {weights.dtype}")
    experts = getattr(ep.experts_forward, "__self__", None)
    if experts is None or getattr(ep.experts_forward, "__func__", None) is not type(experts).forward:
        raise _Decline("the experts forward is not the experts class's own")
    try:
        signature = _signature(experts)
    except AttributeError as exc:
        raise _Decline(f"the experts module is not a @use_experts_implementation one ({exc})") from None
    if experts.num_experts != ep.num_local_experts:
        raise _Decline(f"the experts hold {experts.num_experts} experts, the EP layer counts {ep.num_local_experts}")
    if not isinstance(hidden.shape[-1], int):
        raise _Decline("the hidden size is symbolic")
    # The class itself in the key (the signature names it by module and qualified name only, for the trace): a class
    # redefined under the same name (a re-run notebook cell, importlib.reload) is probed again.
    params = tuple((n, None if p is None else (tuple(_local(p).shape), _local(p).dtype, _local(p).device))
                   for n, p in experts._parameters.items())
    key = (type(experts), signature, params, hidden.dtype, hidden.device)
    if key not in _PROBES:
        try:
            _PROBES[key] = _probe(experts, hidden.dtype, hidden.shape[-1], hidden.device)
        except _Decline as exc:
            _PROBES[key] = str(exc)
    probed = _PROBES[key]
    if isinstance(probed, str):
        raise _Decline(probed)
    return (signature, *probed)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _own(t):
    """The pack hook that keeps a saved tensor as itself (detached: an op's saved output would otherwise hold its own
    grad_fn, a reference cycle)."""
    return t.detach()


def _unpack(t):
    return t


def _own_saved_tensors():
    """Saved-tensor hooks that keep the probe's saved tensors its own, over any checkpoint's; none where saved-tensor
    hooks are disabled (entering them would raise there, and then no checkpoint's hooks are on the stack either)."""
    disabled = getattr(torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)()
    return contextlib.nullcontext() if disabled else torch.autograd.graph.saved_tensors_hooks(_own, _unpack)


def _probe(experts, dtype, hidden_size: int, device):
    """(spec text, (w_up, w_down, b_up, b_down) parameter names) of the experts computation, called as AllToAllEP
    calls it, as patterns/experts.py proves it on a Dynamo graph of it; or _Decline with the pattern's reason."""
    # the same attributes, this rank's shards as plain parameters, the class's forward (its hooks, FSDP's say, are
    # not run: the probe calls forward itself). object.__new__: FSDP's module classes construct in __new__
    twin = object.__new__(type(experts))
    twin.__dict__.update(experts.__dict__)
    twin.__dict__.pop("forward", None)
    twin._parameters = {n: None if p is None else torch.nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad)
                        for n, p in experts._parameters.items()}
    # copies of the buffers and of the plain containers: what the probe's forward changes is the twin's, not the
    # model's (and _state's comparison after the call sees it)
    twin._buffers = {n: None if b is None else _local(b).detach().clone() for n, b in experts._buffers.items()}
    for name, value in experts.__dict__.items():
        if type(value) in (list, dict, set) and not name.startswith("_"):
            twin.__dict__[name] = type(value)(value)
    local = experts.num_experts
    rows = 2 * local
    hidden = torch.randn(rows, hidden_size, dtype=dtype, device=device, requires_grad=True)
    ids = torch.arange(local, device=device).repeat(2).unsqueeze(-1)
    ones = torch.ones(rows, 1, dtype=dtype, device=device)
    state = _state(twin, (hidden, ids, ones))
    graphs, outputs = [], []

    def capture(gm, example_inputs):  # matched here: Dynamo drops the inputs' records once the compile returns
        effects = _graph_side_effects(gm) + _python_side_effects()
        if effects:  # declined before the graph runs: the probe applies none of them to the model
            reason = (f"the experts forward changes {', '.join(effects)}: uniep.ep_layer does not run the experts "
                      "forward, so that side effect would be lost")

            def refuse(*args):
                raise _Decline(reason)
            return refuse
        graphs.append((gm, _match_probe(gm, twin, hidden, ids, ones)))

        def run(*args):
            outputs.append(gm.forward(*args))
            return outputs[-1]
        return run
    forward = type(experts).forward

    def probe(module, h, i, w):
        return forward(module, h, i, w)
    # a fresh code object: Dynamo's cache entries (and its recompile limit) hang on the code object
    probe = types.FunctionType(probe.__code__.replace(), probe.__globals__, "uniep_experts_probe", None,
                               probe.__closure__)
    try:
        # the probe runs while Dynamo traces the model: inside a checkpointed region its saved tensors would otherwise
        # go to the checkpoint's pack hook, which would then count more of them in the forward than the recomputation
        # saves (torch.utils.checkpoint raises); identity hooks on top of the stack keep them the probe's own
        with torch.enable_grad(), _own_saved_tensors():
            returned = torch.compile(probe, backend=capture, fullgraph=True, dynamic=False)(twin, hidden, ids, ones)
    except _Decline:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _Decline(f"the experts forward does not trace into one graph ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    changed = _changes(state, _state(twin, (hidden, ids, ones)))
    if changed:
        raise _Decline(f"the experts forward changes {', '.join(changed)}: uniep.ep_layer does not run the experts "
                       "forward, so that side effect would be lost")
    if len(graphs) != 1:
        raise _Decline(f"the experts forward traced into {len(graphs)} graphs")
    found = graphs[0][1]
    if isinstance(found, str):
        raise _Decline(found)
    # the graph's one output (_require_returns_root) is what the forward returns, not something Python code made of it
    # after the graph ran (a tuple holding it, an input returned instead)
    if len(outputs) != 1 or not isinstance(returned, torch.Tensor) or returned is not _only_output(outputs[0]):
        raise _Decline(f"the experts forward returns {type(returned).__name__}, not the one tensor its graph computes")
    return found


# Steps that give a view of (or the data of) their first argument: an in-place change of their result changes it
_VIEWS = ("view", "view_as", "reshape", "getitem", "select", "narrow", "slice", "transpose", "permute", "expand",
          "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "t", "mT", "T", "detach", "as_strided",
          "contiguous", "split", "chunk", "unbind", "diagonal", "movedim", "_get_data_attr", "data", "alias")


def _step_name(node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target)).split(".")[0]


def _is_view(node) -> bool:
    """The step's result shares its first argument's memory: a view, or basic indexing (ints, slices; an index
    that holds a tensor gathers, into new memory, as HF's ``hidden_states[perm // top_k]`` does)."""
    name = _step_name(node)
    if name == "getitem":
        return not any(isinstance(a, torch.fx.Node) for a in torch.utils._pytree.tree_leaves(node.args[1:]))
    return name in _VIEWS


def _graph_side_effects(gm) -> list:
    """In-place changes the probe graph makes to what it did not create: a graph input (the hidden states, a
    parameter, a buffer of the module or of a child module), through any chain of views (``p.data`` included)."""
    from .patterns.graph_utils import IN_PLACE_OPERATORS

    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        name = _step_name(node)
        written = []
        if (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_OPERATORS:
            written += node.args[:1]
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        written.append(node.kwargs.get("out"))
        for value in written:
            base = value
            while isinstance(base, torch.fx.Node) and base.op in ("call_method", "call_function") and base.args \
                    and _is_view(base):
                base = base.args[0]
            if isinstance(base, torch.fx.Node) and base.op in ("placeholder", "get_attr"):
                found.append(f"{base.target if base.op == 'get_attr' else base.name} in place ({node.name})")
    return found


def _python_side_effects() -> list:
    """The existing Python objects the probe's trace changes (an attribute of the config or of a child module, a
    list, a dict), from Dynamo's side-effect record of the trace being compiled; [] where its internals differ (the
    comparison of the module's state after the call still stands)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables import TensorVariable

        effects = InstructionTranslator.current_tx().output.side_effects
        found = []
        for variable in effects.id_to_variable.values():
            if isinstance(variable, TensorVariable) or not effects.is_modified(variable) \
                    or "New" in type(getattr(variable, "mutation_type", None)).__name__:
                continue
            source = getattr(variable, "source", None)
            name = getattr(source, "name", None)
            where = str(name() if callable(name) else name) if source is not None else type(variable).__name__
            attributes = list(getattr(effects, "store_attr_mutations", {}).get(variable, ()))
            found += [f"{where}.{a}" for a in attributes] or [where]
        return found
    except Exception:  # noqa: BLE001
        return []


def _state(module, inputs) -> dict:
    """What a forward could change beside its output: the module's attributes (which object each name holds), its
    parameters' and buffers' entries and in-place versions, the contents of its plain containers (by identity), the
    inputs' versions."""
    state = {f"attribute {n}": id(v) for n, v in module.__dict__.items()}
    for kind in ("_parameters", "_buffers"):
        for n, t in getattr(module, kind).items():
            state[f"{kind[1:-1]} {n}"] = (id(t), None if t is None else t._version)
    for n, v in module.__dict__.items():
        if type(v) in (list, set):
            state[f"the contents of {n}"] = sorted(id(x) for x in v)
        elif type(v) is dict and not n.startswith("_"):
            state[f"the contents of {n}"] = sorted((repr(k), id(x)) for k, x in v.items())
    for i, t in enumerate(inputs):
        state[f"input {i} in place"] = t._version
    return state


def _changes(before: dict, after: dict) -> list:
    return [k for k in dict.fromkeys([*before, *after]) if before.get(k) != after.get(k)]


def _only_output(values):
    flat = torch.utils._pytree.tree_leaves(values)
    return flat[0] if len(flat) == 1 else None


def _match_probe(gm, twin, hidden, ids, ones):
    """(spec text, parameter names) of the probe's graph, or the reason it is not proven (str)."""
    try:
        return _match_probe_or_decline(gm, twin, hidden, ids, ones)
    except _Decline as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001  (named as the matcher's failure, not as a trace that did not fit one graph)
        return f"uniep could not match the experts graph ({type(exc).__name__}: {exc})"


def _match_probe_or_decline(gm, twin, hidden, ids, ones):
    from .patterns import find_experts_regions

    matches, misses = find_experts_regions(gm.graph)
    if len(matches) != 1:
        reasons = "; ".join(m.reason for m in misses) or "no experts region"
        raise _Decline(f"the experts pattern does not prove the experts ({reasons})")
    match = matches[0]
    if match.spec.post is not None or match.post_operands:
        raise _Decline("post-expert programs (a norm after the experts) are not taken under EP yet")
    if match.compute_dtype is not None or match.out_cast is not None:
        raise _Decline("the experts run under autocast or cast their K-sum's result (the op's output and a cast "
                       "after it; uniep.ep_layer takes neither yet)")
    _require_returns_root(gm, match.root, tuple(hidden.shape))
    inputs = {id(t): name for name, t in (("hidden", hidden), ("ids", ids), ("weights", ones))}
    params = {id(p): n for n, p in twin._parameters.items() if p is not None}
    bound = {what: _bound_tensor(gm, node) for what, node in (("hidden", match.hidden), ("ids", match.topk_ids),
                                                                ("weights", match.topk_weights))}
    for what, tensor in bound.items():
        if tensor is None or inputs.get(id(tensor)) != what:
            raise _Decline(f"the experts match binds its {what} to something other than the experts' input")
    names = []
    for what, node in (("w_up", match.w_up), ("w_down", match.w_down), ("b_up", match.b_up), ("b_down", match.b_down)):
        if node is None:
            names.append(None)
            continue
        tensor = _bound_tensor(gm, node)
        if tensor is None or id(tensor) not in params:
            raise _Decline(f"the experts match's {what} is not one of the experts' parameters")
        names.append(params[id(tensor)])
    spec = dataclasses.replace(match.spec, out_of_range="drop", reuse_saved=False)
    return spec.encode(), tuple(names)


# Steps that may stand between the proven experts region and what the experts forward returns: each keeps every value
# and the gradient path, given that a cast is to the dtype the value has and the reshapes end in the region's shape
# (they keep the row-major order). Anything else (arithmetic, another cast, a transpose, detach) changes the result.
_CASTS = ("to", "type", "type_as", "float", "half", "bfloat16", "double")
_VALUE_PRESERVING = _CASTS + ("view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "clone")


def _require_returns_root(gm, root, shape: tuple) -> None:
    """_Decline unless the probe graph's one output is the experts region's root, up to value-preserving steps, each
    the only reader of the step before, and the region's own casts after its K-sum keep the dtype: uniep.ep_layer
    computes the experts alone, rounded once, so a forward that returns anything else of them (2 * the experts'
    output, say) would be replaced by another value."""
    from .patterns import graph_utils as gu

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = torch.utils._pytree.tree_leaves(output.args)
    if len(flat) != 1 or not isinstance(flat[0], torch.fx.Node):
        raise _Decline(f"the experts forward's graph returns {len(flat)} values, not the experts' output alone")
    want = gu.tensor_meta(root)
    node, reader = flat[0], output
    while True:  # from what the forward returns back to the root
        if list(node.users) != [reader]:
            others = ", ".join(u.name for u in node.users if u is not reader)
            raise _Decline(f"{node.name}, what the experts forward returns (or the experts' output it is made from), "
                           f"is also read by {others}: uniep.ep_layer returns the experts' output alone")
        value = gu.tensor_meta(node)
        if value is None or want is None or value.dtype != want.dtype or value.device != want.device:
            raise _Decline(f"the experts forward returns {node.name} in another dtype or on another device than the "
                           f"experts' output {root.name}")
        if node is root:
            break
        name = gu.op_name(node)
        if name not in _VALUE_PRESERVING or not node.args or node.all_input_nodes != [node.args[0]]:
            raise _Decline(f"the experts forward does not return the experts' output {root.name} as computed: "
                           f"{node.name} ({name or node.op}) changes it; uniep.ep_layer computes the experts alone")
        node, reader = node.args[0], node
    if tuple(gu.tensor_meta(flat[0]).shape) != shape:
        raise _Decline(f"the experts forward returns shape {list(gu.tensor_meta(flat[0]).shape)}, not the hidden "
                       f"states' {list(shape)}")
    # the root is the last of the casts the pattern reads after the K-sum: a chain the op reproduces with its output
    # dtype and a cast after it was declined above (out_cast); one cast left is the op's output dtype, and
    # uniep.ep_layer rounds once, to the hidden states' dtype
    while gu.op_name(node) in _CASTS and node.args and isinstance(node.args[0], torch.fx.Node):
        source = gu.tensor_meta(node.args[0])
        if source is None or source.dtype != want.dtype:
            raise _Decline(f"the experts' output is cast from {source.dtype if source is not None else '?'} to "
                           f"{want.dtype} ({node.name}) after its K-sum: uniep.ep_layer rounds it once")
        node = node.args[0]


def _bound_tensor(gm, node):
    """The real tensor a placeholder (a graph input, or a lifted parameter) or a get_attr node of gm stands for."""
    if node.op == "placeholder":
        arg = node.meta.get("grapharg")
        return None if arg is None else arg.example
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        return obj
    return None
