"""Matched region -> uniep op call."""
from .experts import lower_experts
from .router import lower_router

__all__ = ["lower_experts", "lower_router"]
