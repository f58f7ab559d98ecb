"""Matched region -> uniep op call."""
from .experts import lower_experts

__all__ = ["lower_experts"]
