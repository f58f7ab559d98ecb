"""The package's version: a leaf module, so that the tuning cache (below the kernels) can key on it."""
__version__ = "0.1.0"
