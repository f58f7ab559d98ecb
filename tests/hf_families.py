"""Discover the HF transformers experts classes decorated with @use_experts_implementation and build
tiny random-weight instances of them, without a hand-written list of families."""
from __future__ import annotations

import functools
import importlib
import inspect
import os

import torch

SMALL_SIZES = {
    "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24, "expert_intermediate_size": 24,
    "moe_ffn_hidden_size": 24, "ffn_hidden_size": 48, "expert_hidden_size": 24,
}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")


def _is_decorated(cls) -> bool:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and "use_experts_implementation" in getattr(code, "co_qualname", "")


@functools.lru_cache(maxsize=1)
def discover_experts_classes() -> tuple:
    """((family, class), ...) for every decorated experts class of the installed transformers."""
    import transformers.models

    root = os.path.dirname(transformers.models.__file__)
    found = []
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            if "@use_experts_implementation" not in f.read():
                continue
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == module.__name__ and _is_decorated(obj):
                found.append((family, obj))
    return tuple(found)


def _config_candidates(cls):
    from transformers import PretrainedConfig

    module = importlib.import_module(cls.__module__)
    hint = inspect.signature(cls.__init__).parameters.get("config")
    names = []
    if hint is not None and hint.annotation is not inspect.Parameter.empty:
        names.append(hint.annotation if isinstance(hint.annotation, str) else hint.annotation.__name__)
    names += [n for n, o in vars(module).items() if isinstance(o, type) and issubclass(o, PretrainedConfig)]
    seen = []
    for name in names:
        obj = getattr(module, name, None) if isinstance(name, str) else name
        if isinstance(obj, type) and obj not in seen:
            seen.append(obj)
    return seen


def shrink(config, num_experts=4, top_k=2):
    # Dense defaults leave MoE fields None and VL configs keep per-modality lists: set whatever exists.
    def put(key, value):
        if hasattr(config, key):
            current = getattr(config, key)
            setattr(config, key, [value] * len(current) if isinstance(current, (list, tuple)) else value)

    for key, value in SMALL_SIZES.items():
        put(key, value)
    for key in EXPERT_COUNTS:
        put(key, num_experts)
    if isinstance(getattr(config, "num_experts_per_tok", None), int):
        config.num_experts_per_tok = top_k
    return config


def _sub_configs(config):
    yield config
    for key in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def build_experts(cls, implementation="grouped_mm", dtype=torch.float32, seed=0):
    """A tiny instance of `cls` with normal(0, 0.1) weights; raises if no config of its family fits."""
    errors = []
    for config_cls in _config_candidates(cls):
        try:
            base = config_cls()
        except Exception as exc:  # noqa: BLE001  (configs that need arguments)
            errors.append(f"{config_cls.__name__}(): {exc!r}"[:200])
            continue
        for config in _sub_configs(base):
            shrink(config)
            try:
                torch.manual_seed(seed)
                extra = {}
                parameters = inspect.signature(cls.__init__).parameters
                if "intermediate_size" in parameters:
                    extra["intermediate_size"] = SMALL_SIZES["moe_intermediate_size"]  # the parent passes it
                if "layer_idx" in parameters:  # per-layer settings (BailingHybrid's and Step3p7's SwiGLU limits)
                    extra["layer_idx"] = 0
                experts = cls(config, **extra)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{cls.__name__}({type(config).__name__}): {exc!r}"[:200])
                continue
            experts.config._experts_implementation = implementation
            with torch.no_grad():
                for p in experts.parameters():
                    p.normal_(0.0, 0.1)
            return experts.to(dtype)
    raise RuntimeError(f"no tiny config builds {cls.__name__}: " + "; ".join(errors[:3]))


def experts_dims(experts) -> tuple[int, int]:
    """(num_experts, hidden_size) read off the module's own up-projection weight."""
    weight = experts.gate_up_proj if experts.has_gate else experts.up_proj
    hidden = weight.shape[1] if experts.is_transposed else weight.shape[2]
    return weight.shape[0], hidden


def routed_inputs(experts, tokens=7, top_k=2, dtype=torch.float32, seed=1, requires_grad=True):
    num_experts, hidden = experts_dims(experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_(requires_grad)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, top_k, dtype=torch.long)
    w = torch.rand(tokens, top_k, generator=g).to(dtype).requires_grad_(requires_grad)
    return x, ids, w


SMALL_MODEL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                   max_position_embeddings=64, first_k_dense_replace=0, decoder_sparse_step=1)


def break_router_ties(model, seed=0):
    """HF initializes some routers (and score-correction biases) to zero, so every expert ties for every
    token. torch.topk's choice among ties is implementation-defined and uniep's is the lower id, so a
    comparison with eager needs distinct scores: all-zero floating parameters get small random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def build_causal_lm(cls, implementation="grouped_mm", seed=0):
    """A tiny AutoModelForCausalLM of the family of experts class `cls`, from its config's defaults
    shrunk; raises where the family's defaults do not shrink this simply (composite or hybrid configs)."""
    import transformers

    config = _config_candidates(cls)[0]()
    for sub in _sub_configs(config):
        shrink(sub)
        for key, value in SMALL_MODEL.items():
            if hasattr(sub, key):
                setattr(sub, key, value)
    config._experts_implementation = implementation
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def discover_router_classes() -> tuple:
    """((family, class), ...): the router modules of the families with decorated experts: classes named
    *Router or *Gate whose forward takes the hidden states alone."""
    found = []
    for family in sorted({f for f, _ in discover_experts_classes()}):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, obj in vars(module).items():
            if not (isinstance(obj, type) and obj.__module__ == module.__name__ and issubclass(obj, torch.nn.Module)):
                continue
            if not (name.endswith("Router") or name.endswith("Gate")):
                continue
            params = list(inspect.signature(obj.forward).parameters.values())[1:]
            required = [p for p in params if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                                   p.POSITIONAL_OR_KEYWORD)]
            if len(required) == 1:
                found.append((family, obj))
    return tuple(found)


def build_router(cls, num_experts=8, top_k=2, seed=0):
    """A tiny instance of router class `cls` with random weights; raises if no config of its family fits."""
    errors = []
    for config_cls in _config_candidates(cls):
        try:
            base = config_cls()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{config_cls.__name__}(): {exc!r}"[:200])
            continue
        for config in _sub_configs(base):
            shrink(config, num_experts=num_experts, top_k=top_k)
            if hasattr(config, "num_experts_per_tok") and getattr(config, "num_experts_per_tok") is None:
                config.num_experts_per_tok = top_k  # a dense default config
            for key, value in (("n_group", 4), ("topk_group", 2), ("num_expert_group", 4)):
                if isinstance(getattr(config, key, None), int):
                    setattr(config, key, value)
            try:
                torch.manual_seed(seed)
                router = cls(config)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{cls.__name__}({type(config).__name__}): {exc!r}"[:200])
                continue
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in router.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                for b in router.buffers():
                    if b.is_floating_point():
                        b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            return router, config
    raise RuntimeError(f"no tiny config builds {cls.__name__}: " + "; ".join(errors[:3]))
