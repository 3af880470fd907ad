"""CPU inference products on weights packed once for oneDNN, for forwards of a few tokens.

On CPU, ``x @ W^T`` with a handful of rows runs on BLAS kernels made for one row or for many: a
verification forward of 4-16 tree tokens pays for its extra rows almost as if it were a batch of
separate forwards. oneDNN's matmul on a weight reordered into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) does not. Measured on a 2-core Xeon (AVX-512),
SmolLM2-135M's 120 layer matrices, fp32, ms per forward (rows = tokens in the forward):

    rows            1     2     3     4     8     16    32    200
    BLAS          16.0  18.6  20.0  28.7  34.9  39.4  43.9  163.2
    oneDNN packed 21.3  22.3  22.9  22.8  26.2  30.7  39.2  135.9

and its 49152 x 576 vocabulary projection at 1 / 2 / 3 / 4 / 8 rows: BLAS 2.3 (as ``W @ x^T``; 7.4-7.9
that way from 2 rows on) / 3.2 / 3.8 / 5.4 / 8.5, packed 2.8 / 2.8 / 3.2 / 3.2 / 3.9. So layer products take the packed
weights from :data:`LAYER_MIN_ROWS` rows on and the vocabulary projection from
:data:`VOCAB_MIN_ROWS` (see PolicyModel.vocab_projection). This speeds up every engine alike
(prefill, batched decoding, trees), and changes float32 results only by rounding (~1e-6, as any
change of kernel does); float64 and half precision keep the BLAS path.

The packed copy is made on first use and remade when the weight changes (a new tensor or an
in-place update: its version counter), so an optimizer step or a checkpoint load is picked up. It
doubles the memory of the packed weights on CPU. ``SPECROLL_PACKED_GEMM=0`` switches it off.
Below :data:`LAYER_MIN_ROWS` rows a layer product is ``F.linear``: the BLAS call megatron makes,
without the autograd function megatron wraps it in for the backward (4-8% of a one-token forward).
Likewise the layers' CPU inference forwards leave out megatron's tensor-parallel region functions
where these are identities (the input copy of a column-parallel layer always, as its backward is
what all-reduces; the output all-reduce and gather at TP=1) and call them where they communicate:
121 autograd functions per SmolLM2 forward, ~4% of a one-token forward.
Only inference takes these paths; with gradients enabled, a CPU product whose input needs no
gradient (the heads' layers on the policy's frozen hidden states: head training and slow-path
consolidations) is ``F.linear`` as well, so its backward computes the weight's gradient only
(megatron's computes the input's too, and discards it). On GPU nothing changes.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

LAYER_MIN_ROWS = 4
VOCAB_MIN_ROWS = 2
PACK_ROWS_HINT = 8
"""The row count oneDNN lays the packed weights out for (any count works; 8 measured best of 1 / 8)."""


def enabled() -> bool:
    """On unless ``SPECROLL_PACKED_GEMM=0``, where this torch build has oneDNN and the two ops (torch's
    own, private: those Inductor's CPU weight prepacking uses; checked on torch 2.13)."""
    return (os.environ.get("SPECROLL_PACKED_GEMM", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def cpu_inference(x: torch.Tensor) -> bool:
    """No gradients recorded, CPU input."""
    return not torch.is_grad_enabled() and x.device.type == "cpu"


def applies(x: torch.Tensor, min_rows: int) -> bool:
    """Whether a product of ``x`` [..., in] may run on packed weights: CPU float32 inference of
    ``min_rows`` rows or more."""
    return (cpu_inference(x) and x.dtype == torch.float32 and x.numel() >= min_rows * x.shape[-1]
            and enabled())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (CPU float32) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for x [..., in] with ``packed = pack(weight)``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def vocab_product(x: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight^T`` in CPU inference for a tall ``weight`` [V, h] (a vocabulary projection):
    x [..., h] -> [..., V]. On ``packed`` (its packed copy, given where :func:`applies` with
    :data:`VOCAB_MIN_ROWS`), else as ``weight @ x^T``: BLAS runs ``x @ weight^T`` with one row and
    a tall matrix on a slow kernel."""
    if packed is not None:
        return packed_linear(x, packed)
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    return torch.mm(weight, flat.t()).t().reshape(*x.shape[:-1], weight.shape[0])


class PackedWeight:
    """A parameter's packed copy, remade when the parameter is replaced or updated in place."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._packed: Optional[torch.Tensor] = None

    def get(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed copy; None for a weight created under ``torch.inference_mode`` (no version
        counter: its in-place updates could not be told)."""
        if weight.is_inference():
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key:
            self._packed, self._key = pack(weight), key
        return self._packed


class _PackedForward:
    """Overrides megatron's local product (``_forward_impl``: the matmul and bias of this rank's
    shard, before any TP communication). In CPU inference that product is the packed one from
    :data:`LAYER_MIN_ROWS` rows on, and ``F.linear`` below (the same BLAS call without megatron's
    autograd function around it, whose forward only matters for the backward); the subclasses'
    forwards around it call megatron's region functions only where they communicate."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if weight is self.weight and not kwargs.get("sequence_parallel") and input.device.type == "cpu":
            if not torch.is_grad_enabled():
                return self._inference_product(input, kwargs.get("bias"))
            if (not input.requires_grad and not kwargs.get("gradient_accumulation_fusion")
                    and kwargs.get("grad_output_buffer") is None):
                # a frozen input (heads on the policy's hidden states): megatron's backward would
                # compute and discard the input's gradient; autograd's linear computes the weight's only
                return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)

    def _inference_product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        packed = None
        if applies(x, LAYER_MIN_ROWS):
            if not hasattr(self, "_packed_weight"):
                self._packed_weight = PackedWeight()
            packed = self._packed_weight.get(self.weight)
        return packed_linear(x, packed, bias) if packed is not None else F.linear(x, self.weight, bias)

    def _lean(self, x: torch.Tensor) -> bool:
        """CPU inference without the features whose forward megatron's region functions serve
        (sequence parallelism, expert communication, deferred embedding gradients)."""
        return (cpu_inference(x) and not self.sequence_parallel and not getattr(self, "explicit_expert_comm", False)
                and not getattr(self.config, "defer_embedding_wgrad_compute", False))

    def _tp_size(self) -> int:
        if not hasattr(self, "_tp_world"):
            self._tp_world = torch.distributed.get_world_size(self.tp_group)
        return self._tp_world


class PackedColumnParallelLinear(_PackedForward, ColumnParallelLinear):
    """megatron's ColumnParallelLinear; in CPU inference, products on packed weights and no input copy
    (the identity forward of a function whose backward all-reduces), the gather only at TP > 1."""

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is not None or not self._lean(input_):
            return super().forward(input_, weight, runtime_gather_output)
        # megatron's input copy is the identity forward (its backward all-reduces the input gradient)
        out = self._inference_product(input_, None if self.skip_bias_add else self.bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self._tp_size() > 1:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class PackedRowParallelLinear(_PackedForward, RowParallelLinear):
    """megatron's RowParallelLinear; in CPU inference, products on packed weights and the output
    all-reduce only at TP > 1."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel or not self._lean(input_):
            return super().forward(input_)
        out = self._inference_product(input_, None)
        if self._tp_size() > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None
