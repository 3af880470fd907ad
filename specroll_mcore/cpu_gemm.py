"""CPU inference products on weights packed once, for forwards of a few tokens.

On CPU, ``x @ W^T`` with a handful of rows runs on BLAS kernels made for one row or for many: a
verification forward of 4-16 tree tokens pays for its extra rows almost as if it were a batch of
separate forwards. Two packed layouts do not, each made once per weight:

* **Panels** (:func:`panel_kernels`, ``specroll_mcore/csrc/panel_gemm.cpp``, AVX-512): the weight
  in panels of 16 outputs, ``[out / 16, in, 16]``, read once per call whatever the row count, with
  every output a fused multiply-add chain over ``in`` in order. Up to :data:`PANEL_MAX_ROWS` rows.
  A row's result does not depend on the other rows in the call, so a decode step and a tree
  verification compute a token's layer products bit for bit alike.
* **oneDNN's blocked layout** (``torch.ops.mkldnn._reorder_linear_weight``, as Inductor's CPU weight
  prepacking): from :data:`LAYER_MIN_ROWS` rows (vocabulary projection: :data:`VOCAB_MIN_ROWS`)
  where panels do not apply (more rows, or no panel kernels).

Measured by ``tools/bench_cpu_gemm.py`` (docs/results/cpu_gemm_smollm2.json) on a 2-core Xeon
with AVX-512, SmolLM2-135M's 120 layer matrices, float32, ms per forward (rows = tokens in it):

    rows            1     2     4     8     16    32    64    128
    BLAS          17.1  19.7  30.7  36.9  40.8  48.7  75.4  121.2
    oneDNN packed 24.6  26.3  25.8  29.3  34.2  44.3  69.8  118.4
    panels        15.3  16.2  17.0  20.2  25.3  35.4  58.4  115.5

and its 49152 x 576 vocabulary projection at 1 / 2 / 8 / 16 / 48 rows: BLAS (as ``W @ x^T``: ``x @
W^T`` with one row runs on a slow kernel) 4.4 / 14.6 / 10.2 / 12.2 / 16.2, oneDNN packed 4.8 / 5.3 /
5.5 / 6.9 / 11.8, panels 3.6 / 3.9 / 4.9 / 6.4 / 12.6. This speeds up every engine alike
(prefill, batched decoding, trees) and changes float32 results only by rounding (~1e-6, as any
change of kernel does); float64 keeps the BLAS path.

Half precision (bfloat16, float16) takes :func:`half_product`, ``W @ x^T`` in calls of at most
:data:`HALF_MAX_ROWS` rows: oneDNN's bfloat16 kernels give a row in that form the same result in
any call of two to ~200 rows (every SmolLM2 layer and its vocabulary projection, AVX-512 with AMX;
``x @ W^T`` only up to 32 rows), and in isolated calls faster than ``x @ W^T`` from 16 rows on. A
one-row call runs as two rows (the row twice): oneDNN's one-row kernel sums in another order
(:data:`HALF_ONE_ROW_AS_TWO`). A decode
step and a tree then compute a token's products bit for bit alike, which bfloat16 rounding
otherwise turns into flipped samples (with ordered attention, model/attention.py).

The panel kernels compile on first use into torch's extension cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``; ~25 s once per source, torch version and checkout, with the
C++ compiler and ninja torch's extensions need); where the CPU has no AVX-512 or the build fails (a
warning says why), products take the other kernels. A packed copy is made on first use and remade
when the weight changes (a new tensor or an in-place update: its version counter), so an optimizer
step or a checkpoint load is picked up (or ahead of the next forward: :meth:`PackedWeight.prepare`,
:func:`pack_layers`); each layout made adds the weight's size in memory.
``SPECROLL_PANEL_GEMM=0`` switches panels off, ``SPECROLL_PACKED_GEMM=0`` both packed layouts.
Below :data:`LAYER_MIN_ROWS` rows without panels a layer product is ``F.linear``: the BLAS call
megatron makes, without the autograd function megatron wraps it in for the backward (4-8% of a
one-token forward).
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

import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

LAYER_MIN_ROWS = 4
VOCAB_MIN_ROWS = 2
PANEL_MAX_ROWS = 64
"""Products of up to this many rows run on panels (measured faster than oneDNN's layout up to ~128
layer rows and ~32 vocabulary rows; one bound for both)."""
HALF_MAX_ROWS = 128
"""Half-precision products run in calls of at most this many rows (row-invariant up to ~200 rows on
the CPUs measured; 256 rows of SmolLM2's 1536-input product are not)."""
HALF_ONE_ROW_AS_TWO = True
"""A one-row half-precision product runs as a two-row call (the row twice, one kept): oneDNN's
one-row bfloat16 kernel sums otherwise than its kernel for two rows and more, which alone would break
the row invariance. Measured: without AMX (a 2-core EPYC), a few outputs in 10^4 of products over
more than 1024 inputs (SmolLM2's 1536-input MLP output); with AMX (a 2-core Xeon), rarely over 48
inputs (one token's expert product in a tiny Qwen3-MoE of the tests). With AMX the two-row call is
also the faster one (SmolLM2's 576 x 1536 product 36 against 64 us, 576 x 576 29 against 39 us);
without it, up to 1024 inputs, the slower (80 against 52 us for 576 x 576)."""
PACK_ROWS_HINT = 8
"""The row count oneDNN lays the packed weights out for (any count works; 8 measured best of 1 / 8)."""
PANEL_SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
PANEL_FLAGS = ("-O3", "-mavx512f", "-mfma", "-fopenmp")


def enabled() -> bool:
    """On unless ``SPECROLL_PACKED_GEMM=0``, where this torch build has oneDNN and the two ops (torch's
    own, private: those Inductor's CPU weight prepacking uses; checked on torch 2.13)."""
    return _on("SPECROLL_PACKED_GEMM") and _onednn_ops()


def _on(switch: str) -> bool:
    """An environment switch, on unless set to 0 (read at every product: tools and tests flip them)."""
    return os.environ.get(switch, "1") != "0"


@functools.lru_cache(maxsize=1)
def _onednn_ops() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def panel_kernels() -> Optional[Any]:
    """The compiled panel kernels (``pack_panels``, ``panel_linear``); None with
    ``SPECROLL_PANEL_GEMM=0`` or ``SPECROLL_PACKED_GEMM=0``, where torch does not dispatch to AVX-512
    on this CPU, or where they could not be built."""
    return _build_panel_kernels() if _on("SPECROLL_PANEL_GEMM") and _on("SPECROLL_PACKED_GEMM") else None


@functools.lru_cache(maxsize=1)
def _build_panel_kernels() -> Optional[Any]:
    """Compile and load ``csrc/panel_gemm.cpp`` (AVX-512 CPUs only; see :func:`build_extension`)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    return build_extension(PANEL_SOURCE, PANEL_FLAGS, "products of a few rows take oneDNN's and BLAS's kernels "
                           "(slower, same results up to float32 rounding)", "SPECROLL_PANEL_GEMM")


def build_extension(source: Path, flags: tuple[str, ...], fallback: str, switch: str) -> Optional[Any]:
    """Compile (once per source text, flags, torch version and checkout; cached by torch across
    processes, ``TORCH_EXTENSIONS_DIR``) and load one of ``specroll_mcore/csrc``'s extensions. A failed
    build warns, naming the cause, what runs instead (``fallback``) and the environment ``switch``
    that turns the extension off, and returns None."""
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the pip package's binary, outside PATH in an unactivated venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # one build per source text, flags, torch version and checkout: torch's build file names the
        # source's path, so two checkouts sharing a name would rebuild over each other's library
        key = (str(source.resolve()), torch.__version__) + flags
        digest = hashlib.sha256(source.read_bytes() + " ".join(key).encode())
        name = f"specroll_{source.stem}_{digest.hexdigest()[:12]}"
        _await_build_lock(name)
        ldflags = ["-fopenmp"] if "-fopenmp" in flags else []
        return load(name, [str(source)], extra_cflags=list(flags), extra_ldflags=ldflags, verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: slower, same results
        lines = str(err).strip().splitlines() or [""]
        cause = next((line for line in lines if "error" in line.lower()), lines[-1])  # a build log's first error
        warnings.warn(f"specroll_mcore: the CPU kernels of {source.name} could not be built "
                      f"({type(err).__name__}: {cause.strip()}); {fallback}. Install a C++ compiler and "
                      f"ninja, or set {switch}=0 to silence this.", RuntimeWarning, stacklevel=3)
        return None


STALE_BUILD_LOCK_S = 300.0
"""A build lock this old is a dead build's (a build takes well under a minute)."""


def _await_build_lock(name: str, poll_s: float = 0.02) -> None:
    """Wait for a build of ``name`` in progress elsewhere (another rank, another job) to finish, and
    remove the lock a killed build left. torch waits on that file with no time limit, so after a
    build was killed (SIGKILL during a job's first minute), every later process would hang at its
    first CPU product. A lock is waited on until it goes or is :data:`STALE_BUILD_LOCK_S` old; then
    it is removed, with a warning. Polled often: torch takes the lock to check a built extension is up
    to date too, for milliseconds, and ranks starting together meet it at every start."""
    import time

    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "_get_build_directory"):  # (private; present in torch 2.6-2.13)
        return
    lock = Path(cpp_extension._get_build_directory(name, False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_BUILD_LOCK_S:
            warnings.warn(f"specroll_mcore: removing a build lock left {age / 60:.0f} minutes ago by a build that "
                          f"did not finish ({lock})", RuntimeWarning, stacklevel=3)
            lock.unlink(missing_ok=True)
            return
        time.sleep(min(poll_s, STALE_BUILD_LOCK_S - age + 1e-3))


def contents_key(t: torch.Tensor) -> tuple:
    """What tells a tensor's contents apart from earlier ones: its storage, shape and version counter
    (bumped by every in-place update). Keys the copies made from a weight (packed layouts, the draft
    vocabulary)."""
    return t.data_ptr(), tuple(t.shape), t._version


def cpu_inference(x: torch.Tensor) -> bool:
    """No gradients recorded, CPU input."""
    return not torch.is_grad_enabled() and x.device.type == "cpu"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (CPU float32) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for x [..., in] with ``packed = pack(weight)``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for x [..., in] with ``panels = panel_kernels().pack_panels(weight)``."""
    flat = x.reshape(-1, x.shape[-1])
    out = _build_panel_kernels().panel_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), panels, out_features)
    if bias is not None:
        out.add_(bias)
    return out.reshape(*x.shape[:-1], out_features)


class PackedWeight:
    """A weight's packed copies (panels, oneDNN's layout), each made on first use and remade when the
    weight is replaced or updated in place (its version counter). ``frozen``: a tensor that never
    changes, such as one made under ``torch.inference_mode`` (which has no version counter); without
    it, such a weight is never packed, as its in-place updates could not be told."""

    def __init__(self, frozen: bool = False) -> None:
        self.frozen = frozen
        self._key: Optional[tuple] = None
        self._copies: dict[str, torch.Tensor] = {}

    def product(self, x: torch.Tensor, weight: torch.Tensor, min_rows: int,
                bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``x @ weight^T (+ bias)``, x [..., in], on a packed copy where one applies (CPU float32
        inference: panels up to :data:`PANEL_MAX_ROWS` rows, oneDNN's layout from ``min_rows`` rows
        on); None elsewhere, for the caller's BLAS product."""
        if not (cpu_inference(x) and x.dtype == torch.float32 and weight.dtype == torch.float32
                and weight.shape[0] > 0 and _on("SPECROLL_PACKED_GEMM")) or (weight.is_inference() and not self.frozen):
            return None
        rows = x.numel() // x.shape[-1]
        kernels = _build_panel_kernels() if rows <= PANEL_MAX_ROWS and _on("SPECROLL_PANEL_GEMM") else None
        if kernels is not None:
            return panel_linear(x, self._copy("panels", weight, kernels.pack_panels), weight.shape[0], bias)
        if rows >= min_rows and _onednn_ops():
            return packed_linear(x, self._copy("onednn", weight, pack), bias)
        return None

    def prepare(self, weight: torch.Tensor) -> None:
        """Make now the packed copies of ``weight`` that products may take (panels, where the kernels
        apply, and oneDNN's layout, which products of more rows take), instead of in the first product
        after a weight update: the repacking is then the update's cost, not that of the next forward."""
        if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.shape[0] > 0
                and _on("SPECROLL_PACKED_GEMM")) or (weight.is_inference() and not self.frozen):
            return
        kernels = panel_kernels()
        if kernels is not None:
            self._copy("panels", weight, kernels.pack_panels)
        if _onednn_ops():
            self._copy("onednn", weight, pack)

    def _copy(self, layout: str, weight: torch.Tensor, pack_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        key = (weight.data_ptr(), tuple(weight.shape)) if self.frozen else contents_key(weight)
        if key != self._key:
            self._key, self._copies = key, {}
        if layout not in self._copies:
            self._copies[layout] = pack_fn(weight.detach())
        return self._copies[layout]


def half_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` as ``weight @ x^T`` in calls of at most :data:`HALF_MAX_ROWS` rows of
    x [..., in]: a row's result is the same in any call (see the module docstring). Also the
    float32/float64 vocabulary projection's form off the packed paths."""
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    one_row_pad = HALF_ONE_ROW_AS_TWO and weight.dtype in (torch.bfloat16, torch.float16)

    def call(rows: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] as weight @ rows^T
        if len(rows) == 1 and one_row_pad:
            return torch.mm(weight, rows.expand(2, -1).t())[:, :1].t()
        return torch.mm(weight, rows.t()).t()

    # contiguous: elementwise ops and norms after it take other loops (other roundings) on a transposed view
    out = torch.cat([call(c) for c in flat.split(HALF_MAX_ROWS)]) if len(flat) > HALF_MAX_ROWS \
        else call(flat).contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def vocab_product(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``x @ weight^T`` in CPU inference for a tall ``weight`` [V, h] (a vocabulary projection):
    x [..., h] -> [..., V]. On ``packed`` (its packed copies) where they apply, from
    :data:`VOCAB_MIN_ROWS` rows on oneDNN's layout; else :func:`half_product`'s ``weight @ x^T``:
    BLAS runs ``x @ weight^T`` with one row and a tall matrix on a slow kernel."""
    out = packed.product(x, weight, VOCAB_MIN_ROWS)
    return out if out is not None else half_product(x, weight)


class _PackedForward:
    """Overrides megatron's local product (``_forward_impl``: the matmul and bias of this rank's
    shard, before any TP communication). In inference (no gradients recorded), on any device, that
    product runs without megatron's autograd function around it, whose forward only matters for the
    backward: on CPU a packed product where :meth:`PackedWeight.product` applies, else ``F.linear``
    (the same BLAS or cuBLAS call). The subclasses' forwards around it call megatron's region
    functions only where they communicate. On a GPU, where a small model's forward is bound by the
    host, this takes megatron's per-linear Python and its two autograd functions out of every step
    (both engines alike)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if weight is self.weight and not kwargs.get("sequence_parallel"):
            if not torch.is_grad_enabled():
                return self._inference_product(input, kwargs.get("bias"))
            if (input.device.type == "cpu" and not input.requires_grad
                    and not kwargs.get("gradient_accumulation_fusion") and kwargs.get("grad_output_buffer") is None):
                # a frozen input (heads on the policy's hidden states): megatron's backward would
                # compute and discard the input's gradient; autograd's linear computes the weight's only
                return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)

    def _inference_product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, bias)
        if x.dtype in (torch.bfloat16, torch.float16):
            return half_product(x, self.weight, bias)
        out = self.packed_weight().product(x, self.weight, LAYER_MIN_ROWS, bias)
        return out if out is not None else F.linear(x, self.weight, bias)

    def packed_weight(self) -> PackedWeight:
        """This layer's packed copies of its weight (made on first use, see :class:`PackedWeight`)."""
        if not hasattr(self, "_packed_weight"):
            self._packed_weight = PackedWeight()
        return self._packed_weight

    def _lean(self, x: torch.Tensor) -> bool:
        """Inference (any device) without the features whose forward megatron's region functions serve
        (sequence parallelism, expert communication, deferred embedding gradients)."""
        return (not torch.is_grad_enabled() and not self.sequence_parallel
                and not getattr(self, "explicit_expert_comm", False)
                and not getattr(self.config, "defer_embedding_wgrad_compute", False))

    def _tp_size(self) -> int:
        if not hasattr(self, "_tp_world"):
            self._tp_world = torch.distributed.get_world_size(self.tp_group)
        return self._tp_world


class PackedColumnParallelLinear(_PackedForward, ColumnParallelLinear):
    """megatron's ColumnParallelLinear; in inference, the lean product (on packed weights on CPU) and no input copy
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
    """megatron's RowParallelLinear; in inference, the lean product (on packed weights on CPU) and the output
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


def pack_layers(module: torch.nn.Module) -> None:
    """Pack now the weights of every packed-product layer in ``module`` (:meth:`PackedWeight.prepare`)."""
    for m in module.modules():
        if isinstance(m, _PackedForward):
            m.packed_weight().prepare(m.weight)
