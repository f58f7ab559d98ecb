"""The backend as users meet it: entry point, options, counters."""
import importlib.metadata

import pytest
import torch

import uniep_dynamo
from uniep_dynamo.backend import UniepOptions


def test_entry_point_names_the_backend():
    entry_points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    found = [ep for ep in entry_points if ep.name == "uniep"]
    assert found, "pip install -e . registers the torch_dynamo_backends entry point"
    assert found[0].load() is uniep_dynamo.uniep_backend


def test_backend_is_found_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("uniep") is uniep_dynamo.uniep_backend


def test_unknown_option_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['inner'\]; known options are"):
        UniepOptions.from_options({"inner": "eager"})
    with pytest.raises(ValueError, match="inner_backend 'tvm' is not one of"):
        UniepOptions.from_options({"inner_backend": "tvm"})


def test_rewrite_can_be_switched_off():
    from test_patterns import GraphCapture, HandWrittenExperts, routed

    capture = GraphCapture()
    torch.manual_seed(0)
    module = HandWrittenExperts()
    torch.compile(module, backend="uniep", options={"inner_backend": capture, "rewrite_experts": False})(*routed())
    assert torch.ops.uniep.moe_experts.default not in capture.targets()


def test_tensorrt_without_torch_tensorrt_says_what_to_install():
    pytest.importorskip("transformers")
    try:
        import torch_tensorrt  # noqa: F401
        pytest.skip("torch_tensorrt is installed here; this checks the message without it")
    except ImportError:
        pass
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="needs torch_tensorrt installed"):
        torch.compile(model, backend="uniep", options={"inner_backend": "tensorrt"})(torch.randn(2, 4))
