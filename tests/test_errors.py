"""Clear errors (issue 36): what goes wrong names uniep and the setting the user controls."""
import dataclasses
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from test_patterns import HandWrittenExperts, routed
from uniep_dynamo.backend import UniepOptions


@pytest.mark.parametrize("inner, donated", [
    ("eager", True),  # the op's autograd formula runs the backward op; no AOTAutograd, no donated buffers
    ("aot_eager", True),  # AOTAutograd's backward graph calls the op; its saved tensors donated
    ("aot_eager", False),  # the same, with torch._functorch.config.donated_buffer off
    ("inductor", True),  # inductor's compiled backward (the default inner backend)
])
def test_second_backward_through_reused_buffers_names_the_option(inner, donated):
    """The in-place backward (reuse_saved_buffers, the default) overwrites the saved buffers; a second backward
    through the same graph must say so, naming uniep and the option, not PyTorch's in-place message. A new
    forward's buffers are new: the next step's backward runs, with the first step's gradients. With the option
    off, two backwards through one graph give the same gradients twice."""
    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()
    inputs = [x, w, *module.parameters()]
    with torch._functorch.config.patch(donated_buffer=donated):
        compiled = torch.compile(module, backend="uniep", options={"inner_backend": inner})
        out = compiled(x, ids, w)
        first = torch.autograd.grad(out.sum(), inputs, retain_graph=True)
        with pytest.raises(RuntimeError, match=r"uniep: a second backward .*\"reuse_saved_buffers\": False"):
            torch.autograd.grad(out.sum(), inputs)
        next_step = torch.autograd.grad(compiled(x, ids, w).sum(), inputs)
        assert all(torch.equal(a, b) for a, b in zip(first, next_step))

        kept = torch.compile(module, backend="uniep", options={"inner_backend": inner, "reuse_saved_buffers": False})
        out = kept(x, ids, w)
        twice = [torch.autograd.grad(out.sum(), inputs, retain_graph=True) for _ in range(2)]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*twice, first))
    assert counters["uniep"]["moe_experts"] == 2  # one rewrite per compile: the op ran in both


@pytest.mark.parametrize("name, value, expected", [
    ("share_routing_plan", "no", r"share_routing_plan='no' \(str\); share_routing_plan takes a bool"),
    ("reuse_saved_buffers", 0, r"reuse_saved_buffers=0 \(int\); reuse_saved_buffers takes a bool"),
    ("rewrite_experts", None, r"rewrite_experts=None \(NoneType\); rewrite_experts takes a bool"),
    ("inductor", [("max_autotune", True)], r"inductor=\[\('max_autotune', True\)\] \(list\); inductor takes a dict"),
    ("ep_knobs", "chunks=8", r"ep_knobs='chunks=8' \(str\); ep_knobs takes a dict"),
    ("inner_backend", 3, r"inner_backend=3 \(int\); inner_backend takes one of \('inductor'"),
    ("ep_device_plan", 1, r"ep_device_plan=1 \(int\); ep_device_plan takes True, False or \"auto\""),
    ("ep_device_plan", "on", r"ep_device_plan='on' \(str\); ep_device_plan takes True, False or \"auto\""),
])
def test_option_of_the_wrong_type_is_an_error_naming_it(name, value, expected):
    with pytest.raises(ValueError, match="uniep: option " + expected):
        UniepOptions.from_options({name: value})
    default = UniepOptions.__dataclass_fields__[name]
    right = default.default if default.default is not dataclasses.MISSING else default.default_factory()
    assert getattr(UniepOptions.from_options({name: right}), name) == right  # the option's own default passes


def test_forced_triton_that_cannot_run_says_so_once(monkeypatch, caplog):
    """UNIEP_KERNELS=triton on CPU without TRITON_INTERPRET=1: the reference runs, with one warning naming both."""
    from uniep_dynamo.kernels import megakernel

    monkeypatch.setenv("UNIEP_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(megakernel, "_LOGGED", set())
    torch.manual_seed(0)
    module = HandWrittenExperts()
    x, ids, w = routed()
    with caplog.at_level(logging.WARNING, logger="uniep"):
        for _ in range(2):
            out = torch.compile(module, backend="uniep", options={"inner_backend": "eager"})(x, ids, w)
            out.sum().backward()
    warnings = [r.getMessage() for r in caplog.records if "UNIEP_KERNELS" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "UNIEP_KERNELS=triton" in warnings[0] and "TRITON_INTERPRET=1" in warnings[0]
    assert "reference" in warnings[0]
    assert counters["uniep"]["moe_experts"] == 1  # compiled once, run twice


def test_dynamic_shapes_count_the_graph_that_runs(tmp_path):
    """With dynamic=True AOTAutograd raises TensorifyScalarRestartAnalysis on the first trace (to specialize a
    float scalar); Dynamo throws that graph away and hands uniep a second one. The counters
    and uniep-diff count the graph that runs: two MoE layers, two rewrites each of experts and router. (The restart
    is AOTAutograd's, so inductor behind uniep does the same; aot_eager keeps the test fast.)"""
    pytest.importorskip("transformers")
    from uniep_dynamo import cli

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from hf_models import build_model\n"
        "model = build_model('qwen3_moe')\n"
        "compiled = torch.compile(model, backend='uniep', dynamic=True, options={'inner_backend': 'aot_eager'})\n"
        "compiled(input_ids=torch.randint(0, 96, (2, 5))).logits.sum().backward()\n")
    assert cli.main(["--expect", "moe_experts=2", "--expect", "moe_router=2", str(script)]) == 0
    assert counters["uniep"]["moe_experts"] == 2 and counters["uniep"]["moe_router"] == 2
