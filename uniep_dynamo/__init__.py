"""uniep: a torch.compile backend that rewrites Mixture-of-Experts layers into fused, deterministic ops.

    model = torch.compile(model, backend="uniep")

The backend is found through the ``torch_dynamo_backends`` entry point; importing this package also
registers it by name and registers the ``torch.ops.uniep`` custom ops.
"""
from . import ep, ops  # noqa: F401  (registers torch.ops.uniep.*)
from .backend import UniepOptions, uniep_backend
from .explain import Report, explain
from .report import recording
from .spec import ExpertsSpec
from .version import __version__

__all__ = ["uniep_backend", "UniepOptions", "ExpertsSpec", "ops", "explain", "Report", "recording"]
