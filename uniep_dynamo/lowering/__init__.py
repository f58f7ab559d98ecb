"""Matched region -> uniep op call."""
from .ep import lower_combine, lower_dispatch, lower_exchange
from .experts import lower_experts
from .router import lower_router, share_routing_plan

__all__ = ["lower_combine", "lower_dispatch", "lower_exchange", "lower_experts", "lower_router", "share_routing_plan"]
