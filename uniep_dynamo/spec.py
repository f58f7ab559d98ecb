"""The static attributes of one matched experts region, carried into the op as one string."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from .kernels import gate_program

# float64 is accepted by the op (tests use it as an oracle); the pattern never emits it.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class ExpertsSpec:
    up_layout: str  # "oi": weight stored [E, out, in] (HF default); "io": [E, in, out] (is_transposed)
    down_layout: str
    gate: str  # a gate program (kernels/gate_program.py)
    out_dtype: torch.dtype
    # Expert ids outside [0, E) (HF's expert-parallel sentinels): "drop" -- the slot contributes nothing
    # (HF's grouped_mm spelling); "clamp" -- the slot uses expert clamp(id, 0, E-1) (HF's batched_mm
    # spelling clamps before gathering weights).
    out_of_range: str = "drop"
    # An optional post program on each down-projection row before the routing weight (HF's
    # post-expert norm); it reads the op's post_operands.
    post: str | None = None
    # Backward may reuse the forward's saved buffers as scratch (the in-place backward op): lower peak
    # memory, but a second backward through the same graph (retain_graph=True) then raises.
    reuse_saved: bool = False

    def encode(self) -> str:
        return json.dumps({"up": self.up_layout, "down": self.down_layout, "gate": self.gate,
                           "out_dtype": str(self.out_dtype).replace("torch.", ""), "out_of_range": self.out_of_range,
                           "post": self.post, "reuse_saved": self.reuse_saved}, sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        post = f", post={gate_program.describe(self.post)}" if self.post else ""
        return (f"gate={gate_program.describe(self.gate)}{post}, weights up={self.up_layout} down={self.down_layout}, "
                f"out={str(self.out_dtype).replace('torch.', '')}")


@functools.lru_cache(maxsize=256)
def decode_spec(text: str) -> ExpertsSpec:
    data = json.loads(text)
    for key in ("up", "down"):
        if data[key] not in ("oi", "io"):
            raise ValueError(f"uniep: unknown weight layout {data[key]!r}")
    gate_program.decode(data["gate"])
    out_of_range = data.get("out_of_range", "drop")
    if out_of_range not in ("drop", "clamp"):
        raise ValueError(f"uniep: unknown out_of_range mode {out_of_range!r}")
    post = data.get("post")
    if post is not None and gate_program.decode(post)[0] != "post":
        raise ValueError("uniep: malformed post program")
    return ExpertsSpec(data["up"], data["down"], data["gate"], _DTYPES[data["out_dtype"]], out_of_range, post,
                       bool(data.get("reuse_saved", False)))
