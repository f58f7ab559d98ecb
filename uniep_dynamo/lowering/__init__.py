"""Matched region -> uniep op call."""
from .experts import lower_experts
from .router import lower_router, share_routing_plan

__all__ = ["lower_experts", "lower_router", "share_routing_plan"]
