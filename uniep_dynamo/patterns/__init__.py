"""Structural patterns over Dynamo graphs (one module per subgraph family)."""
from .ep import find_ep_regions, find_layers
from .experts import find_experts_regions
from .router import find_router_regions

__all__ = ["find_ep_regions", "find_layers", "find_experts_regions", "find_router_regions"]
