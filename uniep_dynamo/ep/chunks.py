"""The grouped GEMMs of one rank's local experts, chunk by chunk, through the MegaKernel's public API.

Each chunk's GEMMs are the single-GPU op's launches (kernels/megakernel.py: Layer, rows_gemm, act_backward,
weight_grad) over the chunk's rows and experts, with the config of the single-GPU op over every rank's rows, so the
EP layer keeps its bits. Forward: up projection (activation in its epilogue) and down projection; backward: the
activation gradient, the input gradient and the weight gradients (per chunk, or over every local expert at once).
"""
from __future__ import annotations

import torch

from .layout import Layout


class Chunks:
    """The grouped GEMMs of one rank's local experts, chunk by chunk (the single-GPU MegaKernel's launches
    over a chunk's rows and experts). A GEMM whose output is the chunk's own (the down projection, the
    activation and input gradients, the weight gradients after every chunk) runs as torch._grouped_mm where
    the tile config asks, as in the single-GPU op (same bits: config.py), or as one cuBLAS matmul per expert
    (per_expert_mm, with the row bounds from the host's layout); the up projection writes the saved
    [rows, up_width] buffer and the activation in its epilogue, by Triton (or per_expert_mm)."""

    def __init__(self, layout: Layout, offsets: torch.Tensor, w_up, w_down, b_up, b_down, spec, probe: torch.Tensor,
                 skip_gemms: bool = False, config_shape: tuple | None = None):
        from ..kernels import config as config_mod
        from ..kernels import reference

        self.layout, self.spec, self.skip_gemms = layout, spec, skip_gemms
        self.w_up, self.w_down, self.b_up, self.b_down = w_up, w_down, b_up, b_down
        self.up_width = reference.effective_weight(w_up, spec.up_layout).shape[2]  # [E, H, up_width]
        self.inter = reference.effective_weight(w_down, spec.down_layout).shape[1]  # [E, I, H]
        # the config of the single-GPU op over every rank's rows and all E experts (config_shape: the (rows,
        # experts) of another op whose tiles to take): same tiles, same bits
        rows, experts = config_shape or (layout.total_rows, w_up.shape[0] * layout.world)
        self.config = config_mod.current_config(rows, experts, probe.shape[1], self.inter, probe.device.type != "cuda",
                                                dtype=probe.dtype, device=probe.device)
        self.offsets = offsets  # Layout.to_device
        self._layers = {}  # layer()'s, per chunk

    def layer(self, c: int, probe):
        """(the single-GPU op's Layer over chunk c's rows and experts, their offsets, rows and experts), made once:
        the forward's serve the backward (the forward's probe is of the rows' dtype and device, as the backward's)."""
        from ..kernels import megakernel

        if c not in self._layers:
            e0, e1, lo, hi = self.layout.chunks[c]
            layer = megakernel.Layer(probe, (hi - lo, 1), self.w_up[e0:e1], self.w_down[e0:e1], self.spec,
                                     self.config, up_bias=self.b_up is not None)
            offs = self.offsets[e0:e1]
            # the per_expert_mm GEMMs' row bounds from the host's layout (no host synchronization)
            layer.set_host_bounds(offs, self.layout.chunk_ends(c))
            self._layers[c] = layer, offs, slice(lo, hi), slice(e0, e1)
        return self._layers[c]

    def forward(self, c, x, up, act, scatter=None):
        """up/act rows of chunk c from its received x rows (into the buffers' chunk rows); returns the chunk's
        down projection ([chunk rows, H]), None for a chunk without rows. With ``scatter`` (the layout's
        destinations, the peers' buffers) the down projection goes straight to the peers instead (None)."""
        from ..kernels import megakernel
        from ..kernels.triton_gemm import GLU_FWD, STORE

        layer, offs, rows, experts = self.layer(c, x)
        if rows.stop == rows.start:
            return None
        if self.skip_gemms:
            return x[rows]
        cfg = layer.config
        b_up = self.b_up[experts] if self.b_up is not None else None
        b_down = self.b_down[experts] if self.b_down is not None else None
        megakernel.rows_gemm(layer, cfg.up, a=x[rows], gather=False, row_order=offs, b=layer.up_eff, n=layer.inter,
                             k=layer.hidden_size, epilogue=GLU_FWD, c=up[rows], d=act[rows], bias=b_up, offsets=offs,
                             interleaved=layer.h_interleaved, **layer.weight_halves())
        megakernel.record_h_layout(up[rows], layer.h_interleaved)  # the backward's Chunks check it
        return megakernel.rows_gemm(layer, cfg.down, a=act[rows], gather=False, row_order=offs, b=layer.down_eff,
                                    n=layer.hidden_size, k=layer.inter, epilogue=STORE, bias=b_down, offsets=offs,
                                    scatter=_chunk_scatter(scatter, rows))

    def backward(self, c, x, up, dy, act, d_up, grads, weight_grads: bool = True, scatter=None):
        """Chunk c's input-gradient rows ([chunk rows, H], returned; None for a chunk without rows; with
        ``scatter`` stored straight into the peers' buffers, as in forward), the activation and d_up into the
        chunk's rows of ``act`` and ``d_up``, and, with ``weight_grads``, its experts' weight and bias gradients
        (into grads; else weight_grads does them)."""
        from ..kernels import megakernel
        from ..kernels.triton_gemm import STORE

        layer, offs, rows, experts = self.layer(c, x)
        if rows.stop == rows.start:  # no rows: the chunk's experts' gradients are zero
            if weight_grads:
                zero_grads(grads, experts)
            return None
        if self.skip_gemms:
            return dy[rows]
        megakernel.check_h_layout(up[rows], layer.h_interleaved)
        cfg = layer.config
        d_act = megakernel.rows_gemm(layer, cfg.grad_act, a=dy[rows], gather=False, row_order=offs,
                                     b=layer.down_eff.transpose(1, 2), n=layer.inter, k=layer.hidden_size,
                                     epilogue=STORE, offsets=offs)
        megakernel.act_backward(layer, d_act=d_act, up=up[rows], d_up=d_up[rows], act=act[rows], offsets=offs,
                                **layer.h_halves())
        del d_act
        d_x = megakernel.rows_gemm(layer, cfg.grad_input, a=d_up[rows], gather=False, row_order=offs,
                                   b=layer.up_eff.transpose(1, 2), n=layer.hidden_size, k=layer.up_width,
                                   epilogue=STORE, offsets=offs,
                                   scatter=_chunk_scatter(scatter, rows), interleaved=layer.h_interleaved)
        if weight_grads:
            self._weight_grads(layer, offs, rows, experts, x, dy, act, d_up, grads)
        return d_x

    def weight_grads(self, x, dy, act, d_up, grads):
        """Every local expert's weight and bias gradients in one grouped GEMM each, after every chunk's
        backward (which left the activation in ``act`` and its gradient in ``d_up``). The weight gradients
        are new tensors, put in grads[0] and grads[1] (new_grads left None there); the bias gradients go
        into their buffers."""
        from ..kernels import megakernel

        if self.skip_gemms:
            grads[0], grads[1] = torch.empty_like(self.w_up), torch.empty_like(self.w_down)
            return
        rows, experts = slice(0, self.layout.rows), slice(0, self.w_up.shape[0])
        if self.layout.rows == 0:
            grads[0], grads[1] = torch.zeros_like(self.w_up), torch.zeros_like(self.w_down)
            zero_grads(grads[2:])  # the bias gradients' buffers
            return
        layer = megakernel.Layer(x, (self.layout.rows, 1), self.w_up, self.w_down, self.spec, self.config,
                                 up_bias=self.b_up is not None)
        ends = self.layout.ends(x.device)
        layer.set_host_bounds(ends, self.layout.expert_end)
        self._weight_grads(layer, ends, rows, experts, x, dy, act, d_up, grads)

    def _weight_grads(self, layer, offs, rows, experts, x, dy, act, d_up, grads):
        """The weight and bias gradients of the given experts over the given rows: into grads[0] and grads[1]'s
        experts, or, where those are None, as new tensors put there (by torch._grouped_mm where the config asks)."""
        from ..kernels import megakernel

        d_w_up, d_w_down, d_b_up, d_b_down = grads
        cfg = layer.config
        down_dims = (1, 2) if self.spec.down_layout == "io" else (2, 1)
        up_dims = (1, 2) if self.spec.up_layout == "io" else (2, 1)
        d_w_down = megakernel.weight_grad(
            layer, cfg.wgrad_down, p=act[rows], p_gather=False, q=dy[rows], q_gather=False, q_scale=False,
            row_order=offs, w=None, offsets=offs,
            grad=d_w_down[experts] if d_w_down is not None else self.w_down.shape, m_dim=down_dims[0],
            n_dim=down_dims[1], bias_grad=d_b_down[experts] if d_b_down is not None else None)
        if grads[1] is None:
            grads[1] = d_w_down
        d_w_up = megakernel.weight_grad(
            layer, cfg.wgrad_up, p=x[rows], p_gather=False, q=d_up[rows], q_gather=False, q_scale=False,
            row_order=offs, w=None, offsets=offs, grad=d_w_up[experts] if d_w_up is not None else self.w_up.shape,
            m_dim=up_dims[0], n_dim=up_dims[1], bias_grad=d_b_up[experts] if d_b_up is not None else None,
            q_interleaved=layer.h_interleaved)
        if grads[0] is None:
            grads[0] = d_w_up


def _chunk_scatter(scatter, rows: slice):
    """A chunk's part of _exchange's ``scatter`` (the destinations of its rows, the peers' buffers), or None."""
    return (scatter[0][rows], scatter[1]) if scatter is not None else None


def new_grads(w_up, w_down, b_up, b_down, weights: bool = True):
    """[d_w_up, d_w_down, d_b_up, d_b_down]: buffers the chunks write their experts' part of (None for a missing
    bias). With weights=False the weight gradients' entries are None: Chunks.weight_grads makes them."""
    return [torch.empty_like(w_up) if weights else None, torch.empty_like(w_down) if weights else None,
            torch.empty_like(b_up) if b_up is not None else None,
            torch.empty_like(b_down) if b_down is not None else None]


def zero_grads(grads, experts=slice(None)):
    """Zero the given experts' rows of each gradient (None stays None); returns the list."""
    for g in grads:
        if g is not None:
            g[experts].zero_()
    return grads
