"""Kernels of the uniep ops. ``reference`` is the pure-PyTorch oracle and the CPU path."""
