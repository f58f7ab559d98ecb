"""End to end through HF's Trainer, as people fine-tune MoE models: gradient checkpointing, AdamW, gradient
accumulation, fp32 or bf16 autocast (examples/trainer_qwen3_moe.py, run here on a tiny Qwen3-MoE). The rewrite
fires inside the checkpoint bodies, the loss curve equals eager's, and two runs end bitwise equal."""
import argparse
import importlib.util
import os

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import TOLERANCE

pytest.importorskip("accelerate", reason="HF's Trainer needs accelerate")

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "trainer_qwen3_moe.py")
_spec = importlib.util.spec_from_file_location("trainer_qwen3_moe", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _args(tmp_path, **overrides):
    defaults = dict(steps=3, layers=2, hidden=32, experts=4, vocab=96, batch=2, seq=12, accumulation=2, bf16=False,
                    output_dir=str(tmp_path))
    return argparse.Namespace(**{**defaults, **overrides})


# fp32; and Trainer's bf16=True, the usual mixed-precision recipe (autocast to bfloat16 around the fp32 model:
# on the CPU HF's grouped_mm experts stay fp32, the router's linear runs in bf16; patterns/autocast.py)
@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_with_checkpointing_and_accumulation_matches_eager(tmp_path, bf16):
    args = _args(tmp_path, bf16=bf16)
    eager, eager_model = example.train(args, None)
    options = {"inner_backend": "aot_eager"}
    uniep, model = example.train(args, "uniep", options)
    assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["moe_router"] == 2
    assert counters["uniep"]["unfused"] == 0 and counters["uniep"]["router_unfused"] == 0
    assert len(uniep) == len(eager) == args.steps
    tolerance = TOLERANCE[torch.bfloat16 if bf16 else torch.float32]
    for a, b in zip(uniep, eager):
        assert abs(a - b) <= tolerance * abs(b), (uniep, eager)
    if not bf16:  # (in bf16, AdamW's normalised steps amplify rounding differences of near-zero gradients)
        eager_params = dict(eager_model.named_parameters())
        for name, p in model.named_parameters():  # after three AdamW steps
            assert torch.allclose(p, eager_params[name], rtol=1e-4, atol=1e-6), name
    again, model_again = example.train(args, "uniep", options)
    assert again == uniep
    again_params = dict(model_again.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, again_params[name]), name
