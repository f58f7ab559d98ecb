"""Structural patterns over Dynamo graphs (one module per subgraph family)."""
from .experts import find_experts_regions
from .router import find_router_regions

__all__ = ["find_experts_regions", "find_router_regions"]
