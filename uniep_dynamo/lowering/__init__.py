"""Matched region -> uniep op call."""
from .ep import lower_combine, lower_dispatch, lower_exchange, lower_layer
from .experts import lower_experts
from .router import lower_router, share_routing_plan

__all__ = ["lower_combine", "lower_dispatch", "lower_exchange", "lower_experts", "lower_layer", "lower_router",
           "share_routing_plan"]
