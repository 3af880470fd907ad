"""Counter-based sampling: the exactness contract's source of randomness.

The token at response position t of (prompt i, sample j) in rollout step ``step`` is

    argmax_v( filtered_logits[v] / T + g[v] ),   g = Gumbel(seed, step, i, j, t, v)

where the Gumbel noise is a pure function of those integers (a stateless hash, no RNG state).
The sample therefore depends on nothing else: not on batch size or order, on which other rows are
running, on TP/PP, or on whether a speculative engine produced the logits. T = 0 is greedy.

Pure tensor functions; no torch.distributed.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

_M32 = 0xFFFFFFFF


def _fmix32(h: Any) -> Any:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values (full avalanche), or on
    Python integers.

    The products can exceed 2**63 and wrap; only the low 32 bits are kept, which wrapping preserves.
    """
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """:func:`_fmix32` in place on an int64 tensor: the same values and as many operations, with one
    temporary of its size at a time instead of a new tensor per operation (the noise over a
    vocabulary: its memory on a GPU)."""
    h ^= h >> 16
    h.mul_(0x85EBCA6B).bitwise_and_(_M32)
    h ^= h >> 13
    h.mul_(0xC2B2AE35).bitwise_and_(_M32)
    h ^= h >> 16
    return h


def _combine(h: Any, x: Any) -> Any:
    """Mixes x into the hash h (tensors or Python integers; h's part reduced to 32 bits before it
    meets x, so that a Python integer h stays within int64 when x is a tensor)."""
    return _fmix32((((h * 0x9E3779B1 + 0x7F4A7C15) & _M32) + (x & _M32)) & _M32)


@dataclass(frozen=True)
class SampleKeys:
    """Counter keys of n tokens to sample: one (prompt, sample, position) each, shared seed/step.
    ``hashes``: their :meth:`row_hash`, where it was computed once for keys used several times
    (:meth:`with_hashes`; subsets by :meth:`rows` and :meth:`select` carry theirs along)."""

    seed: int
    step: int
    prompt: torch.Tensor  # [n] long
    sample: torch.Tensor  # [n] long
    position: torch.Tensor  # [n] long, 0-based index in the response
    hashes: Optional[torch.Tensor] = None  # [n] long, the row hashes (None: computed at each use)

    def rows(self, start: int, end: int) -> "SampleKeys":
        """Keys start .. end - 1."""
        return SampleKeys(self.seed, self.step, self.prompt[start:end], self.sample[start:end],
                          self.position[start:end], None if self.hashes is None else self.hashes[start:end])

    def select(self, index: torch.Tensor) -> "SampleKeys":
        """Keys ``index`` [m] (long), in that order."""
        return SampleKeys(self.seed, self.step, self.prompt.index_select(0, index), self.sample.index_select(0, index),
                          self.position.index_select(0, index),
                          None if self.hashes is None else self.hashes.index_select(0, index))

    def with_hashes(self) -> "SampleKeys":
        """These keys with their row hashes computed now, for several uses."""
        return self if self.hashes is not None else replace(self, hashes=self.row_hash())

    def row_hash(self) -> torch.Tensor:
        """[n] int64 (uint32 values): the hash of each key's fields, which every token id's noise
        mixes in (on CPU by :func:`noise_kernel` where it is built, in one call)."""
        if self.hashes is not None:
            return self.hashes
        kernel = noise_kernel() if self.prompt.device.type == "cpu" else None
        if kernel is not None:
            return kernel.counter_row_hash((self.seed ^ 0x5BD1E995) & _M32, self.step, self.prompt, self.sample,
                                           self.position)
        return self._torch_row_hash()

    def _torch_row_hash(self) -> torch.Tensor:
        """:meth:`row_hash` in torch's int64 ops (any device; the kernel's reference). The seed and
        step, the same for every key, are mixed in Python's integers (the same low 32 bits), so a
        call launches 45 elementwise operations instead of 72 (on a GPU each is a kernel launch)."""
        h = _combine(_fmix32((self.seed ^ 0x5BD1E995) & _M32), self.step)
        for field in (self.prompt, self.sample, self.position):
            h = _combine(h, field)
        return h  # [n]


@functools.lru_cache(maxsize=8)
def _vocab_ids(start: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[1, vocab] ids start .. start + vocab - 1, made once (every sample reads them; an arange of a
    vocabulary at every call cost ~20 us on CPU). A normal tensor, also when first asked for under
    inference mode, and never written to."""
    with torch.inference_mode(False):
        return torch.arange(start, start + vocab, dtype=torch.long, device=device)[None]


def _uniform(hashes: torch.Tensor) -> torch.Tensor:
    """uint32 hashes (int64) -> uniforms in (0, 1), float64 (computed in place on the new tensor)."""
    return hashes.to(torch.float64).add_(0.5).mul_(1.0 / 2**32)


def _gumbel(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g = -log(E) with E = -log(u) ~ Exp(1). E is computed in float64 (u close to 1 needs it: those
    are the largest g); its logarithm in float32 is exact to float32 precision. Overwrites ``u``."""
    return u.log_().neg_().to(torch.float32).log_().neg_().to(dtype)


CPU_CHUNK = 1 << 16
"""Elements per pass of the noise on CPU, so that its int64 / float64 temporaries stay in a core's
cache: 256 rows x 49152 ids took 544 ms in one pass and 76 ms in chunks of 65536 (the same values)."""

NOISE_SOURCE = Path(__file__).parent / "csrc" / "counter_noise.cpp"


def noise_kernel() -> Optional[Any]:
    """The compiled uniforms of the noise on CPU (``csrc/counter_noise.cpp``: the hash in uint32
    arithmetic, one pass, the same values as :func:`_uniform` of :func:`_fmix32`); None with
    ``SPECROLL_NOISE_KERNEL=0`` or where it could not be built (torch's ops then compute them)."""
    return _build_noise_kernel() if os.environ.get("SPECROLL_NOISE_KERNEL", "1") != "0" else None


@functools.lru_cache(maxsize=1)
def _build_noise_kernel() -> Optional[Any]:
    """Compile and load ``csrc/counter_noise.cpp`` once per process (cached by torch across processes)."""
    from specroll_mcore.cpu_gemm import build_extension

    vector = ("-mavx2",) if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ()
    return build_extension(NOISE_SOURCE, ("-O3", "-fopenmp") + vector,
                           "the sampling noise is computed by torch's ops (slower, the same values)",
                           "SPECROLL_NOISE_KERNEL")


def _torch_uniform(row_hash: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What the noise kernel computes, in torch's int64 ops: row_hash [n], ids [1 or n, s] -> [n, s]."""
    return _uniform(_fmix32_(row_hash[:, None] ^ ((ids * 0x9E3779B1) & _M32)))


def _noise(keys: SampleKeys, ids: torch.Tensor, gumbel: bool, dtype: torch.dtype) -> torch.Tensor:
    """Uniforms or Gumbels for token ``ids`` ([1, s] for every key, or [n, s] per key) -> [n, s]:
    one avalanche round of (row hash, token id), computed in row chunks on CPU (the uniforms by
    :func:`noise_kernel` where it is built), in one pass elsewhere (into no buffer of its own)."""
    h = keys.row_hash()
    n, s = h.shape[0], ids.shape[1]
    cpu = h.device.type == "cpu"
    kernel = noise_kernel() if cpu else None
    uniform = kernel.counter_uniform if kernel is not None else _torch_uniform
    rows = max(1, CPU_CHUNK // max(s, 1)) if cpu else n
    if 0 < n <= rows:
        u = uniform(h, ids)
        return _gumbel(u, dtype) if gumbel else u.to(dtype)
    out = torch.empty(n, s, dtype=dtype, device=h.device)
    for a in range(0, n, rows):
        u = uniform(h[a:a + rows], ids if ids.shape[0] == 1 else ids[a:a + rows])
        out[a:a + rows] = _gumbel(u, dtype) if gumbel else u
    return out


def uniform_noise(keys: SampleKeys, vocab: int, dtype: torch.dtype = torch.float64, start: int = 0) -> torch.Tensor:
    """[n, vocab] uniforms in (0, 1), one per (key, token id) for ids start .. start + vocab - 1."""
    return _noise(keys, _vocab_ids(start, vocab, keys.prompt.device), False, dtype)


def gumbel_noise(keys: SampleKeys, vocab: int, dtype: torch.dtype = torch.float64, start: int = 0) -> torch.Tensor:
    """[n, vocab] standard Gumbel noise, a pure function of (seed, step, prompt, sample, position, v),
    for token ids v = start .. start + vocab - 1 (a vocabulary shard reads its own slice)."""
    return _noise(keys, _vocab_ids(start, vocab, keys.prompt.device), True, dtype)


def gumbel_noise_at(keys: SampleKeys, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The entries of :func:`gumbel_noise` for some token ids only: ids [n, s] -> [n, s]."""
    return _noise(keys, ids, True, dtype)


def first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """[n, V] -> the first maximal index of each row [n] (torch's argmax, a NaN counting as the
    maximum): for CPU float32 rows by :func:`noise_kernel`'s ``first_argmax`` where it is built,
    else from ``max(dim).indices`` (the same indices; on CPU a faster kernel than argmax's)."""
    kernel = noise_kernel() if scores.device.type == "cpu" and scores.dtype == torch.float32 else None
    if kernel is not None and scores.shape[-1] > 0:
        return kernel.first_argmax(scores)
    return scores.max(dim=-1).indices


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision and float32 tensors; float64 stays float64 (the exact reference mode)."""
    return x if x.dtype == torch.float64 else x.float()


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  min_p: float = 0.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p; removed tokens get -inf. logits [n, V] -> [n, V].

    Min-p keeps the ids whose probability is at least ``min_p`` times the best one's, i.e. whose
    scaled logit is at least the best one's + log(min_p) (the best token always stays, so it does not
    matter whether the probabilities are those before or after top-k and top-p).
    Temperature 0 leaves the logits unscaled (greedy sampling takes the argmax). Without filters,
    temperature 1 returns ``logits`` itself (dividing by 1 changes no value)."""
    x = logits.clone() if temperature == 0 else logits if temperature == 1 else logits / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = _nucleus(x.reshape(-1, vocab), top_p).view(x.shape)
    if min_p > 0:
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(min_p), float("-inf"))
    return x


NUCLEUS_WINDOW = 256
"""Ids a row's top-p cut is first looked for among on CPU (its most likely ones, by a top-k):
sorting a row of SmolLM2's 49152 ids takes ~3 ms on a 2-core CPU, a top-256 a fraction of it
(16-response rollouts at top-p 0.95: 1.3x faster, docs/results/README.md)."""


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on scaled logits [n, V]: ids whose better ids' probability reaches top_p get -inf (never
    the best one). On CPU each row's cut is looked for among its :data:`NUCLEUS_WINDOW` most likely
    ids, with the row's own log-sum-exp; a row whose cut lies beyond them (its window's last id is
    kept) is sorted whole. Which way a row goes depends on its values alone, so the kept ids do not
    depend on the other rows of the call (the exactness contract: a tree's rows sample as one-token
    ones). On a GPU every row is sorted whole: a sort is cheap there, and choosing would wait for
    the device."""

    def cut(sorted_x: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:  # drop mask, in sorted order
        probs = (sorted_x - log_z).exp_()  # (in place where a new tensor is not needed: the memory on a GPU)
        return torch.cumsum(probs, dim=-1).sub_(probs) >= top_p  # mass of strictly better ids

    def sorted_whole(rows: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:  # drop mask of whole rows
        sorted_x, order = torch.sort(rows, dim=-1, descending=True)
        return torch.zeros_like(rows, dtype=torch.bool).scatter_(-1, order, cut(sorted_x, log_z))

    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    if not (NUCLEUS_WINDOW < x.shape[-1] and x.device.type == "cpu"):
        return x.masked_fill(sorted_whole(x, log_z), float("-inf"))
    values, order = torch.topk(x, NUCLEUS_WINDOW, dim=-1)  # descending
    drop_sorted = cut(values, log_z)
    drop = torch.ones_like(x, dtype=torch.bool).scatter_(-1, order, drop_sorted)
    beyond = ~drop_sorted[:, -1]  # rows whose window's last id is kept: their cut lies past it
    if bool(beyond.any()):
        rows = beyond.nonzero()[:, 0]
        drop.index_copy_(0, rows, sorted_whole(x.index_select(0, rows), log_z.index_select(0, rows)))
    return x.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, keys: SampleKeys, temperature: float, top_p: float = 1.0,
           top_k: int = 0, min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits [n, V] (true vocabulary).

    Returns tokens [n] and their log-probs [n] under the sampling distribution (after temperature,
    top-k, top-p and min-p: :func:`filter_logits`). At T = 0 the token is the argmax and the log-prob
    is that of the unscaled, unfiltered softmax.
    """
    if temperature == 0:
        tokens = first_argmax(logits)
        logp = torch.log_softmax(upcast(logits), dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    x = filter_logits(logits, temperature, top_p, top_k, min_p)
    # the argmax of x + g (the first maximal index), summed into the noise's own buffer
    tokens = first_argmax(gumbel_noise(keys, x.shape[-1], x.dtype).add_(x))
    logp = torch.log_softmax(upcast(x), dim=-1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def top_distribution(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits [n, V] -> the ids and probabilities of the k most likely tokens [n, k] (float32, or
    float64 for float64 logits)."""
    logits = upcast(logits)
    values, ids = logits.topk(k, dim=-1)
    return ids, torch.exp(values - torch.logsumexp(logits, -1, keepdim=True))
