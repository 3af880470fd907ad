"""Process groups and the megatron-core parallel state.

This is the only module that reads ``megatron.core.parallel_state`` or calls ``torch.distributed``
collectives; everything else receives a :class:`ParallelContext` (the one exception: a sharded
optimizer, optimizer.py, broadcasts its stepped parameters on the data-parallel group it is given).

Launch with ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment) or as a plain
single process. gloo on CPU, nccl on GPU, chosen automatically unless the config says otherwise.

megatron-core compatibility
---------------------------
megatron-core 0.16.1 assumes CUDA in a few places we reach (:func:`apply_cpu_compat`) and Transformer
Engine in one (:func:`apply_megatron_compat`), and builds its fused kernels' ``torch.compile``
wrappers as it is imported (:func:`defer_megatron_compiles`). Those three functions are the complete
list of what we change, and why; nothing else in the project patches megatron-core. One private name
is read, not changed: the list of the process groups megatron-core created
(:func:`_destroy_model_parallel`), so that a process which initialises another layout destroys the
old groups rather than leaking them; :func:`initialize` in the layout already initialised keeps its
groups.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.abc
import importlib.machinery
import math
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from specroll_mcore.config import ModelConfig, ParallelConfig, pipeline_split

_CPU_COMPAT_APPLIED = False
_MEGATRON_COMPAT_APPLIED: list[str] = []
_INITIALIZED: Optional[tuple] = None
"""(default process group, TP, PP, EP) of megatron's parallel state as :func:`initialize` last set it."""
_IN_FLIGHT: dict[int, tuple] = {}
"""Every context's pipeline sends not waited for yet, (work, tensor) by id (:meth:`ParallelContext.post_forward`),
held here too: a send must outlive the context that posted it (a gloo work dropped before the next
stage receives never arrives there), and is waited for before the parallel state is set up again
(:func:`wait_for_sends`)."""


def wait_for_sends() -> None:
    """Wait for every pipeline send still in flight, whichever context posted it (:func:`initialize`
    and :func:`destroy` do first: a job that ends on a forward the next stage has yet to receive)."""
    _wait(list(_IN_FLIGHT.values()))


def _wait(sends: Sequence[tuple]) -> None:
    """Wait for each (work, tensor) of ``sends`` and drop it from :data:`_IN_FLIGHT`."""
    for entry in sends:
        entry[0].wait()
        _IN_FLIGHT.pop(id(entry), None)


def apply_cpu_compat() -> list[str]:
    """Make the megatron-core code paths we use run without CUDA. Idempotent; a no-op with CUDA.

    Items (each one is needed by a path we use, and is tested in tests/unit/test_parallel.py):

    1. ``torch.cuda.current_device`` answers the CPU device. megatron-core allocates communication
       buffers with ``device=torch.cuda.current_device()`` (tensor_parallel/mappings.py all-gathers,
       tensor_parallel/layers.py) and would raise "Torch not compiled with CUDA enabled"; on a CPU
       machine the right device for those buffers is the CPU.

    2. Only while megatron-core builds a model (:func:`cpu_model_construction`): ``Tensor.cuda``
       returns the tensor itself. ``LanguageModule.setup_embeddings_and_output_layer`` moves the
       tied embedding to CUDA before all-reducing it between the first and last pipeline stages
       (tied embeddings with PP > 1); on CPU the all-reduce must happen where the tensor is.

    3. megatron-core's all-to-all token dispatcher (expert parallelism) without CUDA streams. It
       creates a CUDA stream when it is first built and, at one point of every dispatch, copies the
       split sizes of its all-to-alls to the host on that stream and waits for it there
       (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``); without CUDA both raise. On a
       CPU the sizes are on the host already: the class gets a placeholder stream, and the method
       turns the split sizes into the host arrays megatron-core hands to the all-to-all, at the same
       point, with nothing to wait for.

    Not patched, replaced instead: megatron's ``DotProductAttention`` (CUDA RNG tracker, global
    memory buffer) is swapped for our own core attention in the layer spec (model/attention.py), and
    its RoPE for ours (positions per row, needed for ragged KV caches and trees).

    Returns the list of items applied.
    """
    global _CPU_COMPAT_APPLIED
    if torch.cuda.is_available():
        return []
    if not _CPU_COMPAT_APPLIED:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_split_sizes
        _CPU_COMPAT_APPLIED = True
    return ["torch.cuda.current_device -> cpu",
            "MoEAlltoAllTokenDispatcher: no CUDA stream, split sizes to host arrays without one"]


_NO_STREAM = object()
"""The all-to-all token dispatcher's stream on a CPU (item 3 of :func:`apply_cpu_compat`): never used."""


def _host_split_sizes(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on a CPU (item 3 of
    :func:`apply_cpu_compat`): at the dispatcher's copy point, the split sizes of its all-to-alls
    become host arrays, as megatron-core's version leaves them; the tensors are on the host, so
    there is no stream to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def apply_megatron_compat() -> list[str]:
    """Make megatron-core paths we use run without Transformer Engine, on CPU and GPU alike. Idempotent.

    Items (tested in tests/unit/test_parallel.py):

    1. ``moe_utils.te_general_gemm`` is defined as None where megatron-core left it undefined.
       megatron-core 0.16.1 imports it only when Transformer Engine is installed, yet the router's
       gating product (``RouterGatingLinearFunction``, every mixture-of-experts forward) tests it
       for None: without Transformer Engine that raises NameError. None is the value megatron-core
       means for "not installed"; the router then computes its product with ``torch.mm``. (0.17 and
       later define it as None themselves: nothing is applied there.)

    Returns the list of items applied (empty where megatron-core needs none of them).
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _MEGATRON_COMPAT_APPLIED.append("moe_utils.te_general_gemm -> None")
    return list(_MEGATRON_COMPAT_APPLIED)


def defer_megatron_compiles() -> list[str]:
    """Have megatron-core compile its fused kernels on their first call, not when it is imported.
    Idempotent; takes effect where megatron-core is imported after it (the package runs it on import).

    Item (tested in tests/unit/test_parallel.py): ``megatron.core.jit.jit_fuser``, the decorator of
    megatron-core's fused kernels (bias-GeLU, SwiGLU, the MoE router's helpers, ...), is
    ``torch.compile``, which imports TorchDynamo and Inductor as soon as it decorates anything: ~0.9 s
    at every import of megatron-core on a 2-core CPU, and ~0.5 s more at every process exit, in every
    rank, CLI run and tool, for kernels our layers never call (ModelConfig turns every fusion off).
    Once megatron.core.jit is loaded its ``jit_fuser`` becomes a decorator that calls
    ``torch.compile`` with the kernel at its first call and runs the compiled kernel from then on:
    what torch.compile's wrapper does anyway, which compiles at the first call too.

    megatron-core 0.17 and later also decorate two methods of their inference router with
    ``torch.compile`` itself, which imports TorchDynamo as that module loads; left alone (it is a
    decorator applied at import, not a setting).

    Returns the list of items in place (empty where megatron-core, imported first, chose another
    ``jit_fuser``).
    """
    jit = sys.modules.get("megatron.core.jit")
    if jit is None:
        if not any(isinstance(finder, _DeferredJitFuser) for finder in sys.meta_path):
            sys.meta_path.insert(0, _DeferredJitFuser())
    elif jit.jit_fuser is torch.compile:  # (imported already: its later importers get the deferral)
        jit.jit_fuser = compile_on_first_call
    deferred = jit is None or jit.jit_fuser is compile_on_first_call
    return ["megatron.core.jit.jit_fuser -> torch.compile at a kernel's first call"] if deferred else []


def compile_on_first_call(fn: Any) -> Any:
    """``torch.compile`` as megatron-core's ``jit_fuser`` applies it, compiling ``fn`` at its first
    call (item of :func:`defer_megatron_compiles`)."""
    compiled = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


class _DeferredJitFuser(importlib.abc.MetaPathFinder):
    """Loads ``megatron.core.jit`` as usual, then swaps its ``jit_fuser`` for
    :func:`compile_on_first_call` before any kernel module imports it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            if module.jit_fuser is torch.compile:  # (left alone where megatron-core chose otherwise)
                module.jit_fuser = compile_on_first_call

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


@contextlib.contextmanager
def cpu_model_construction() -> Iterator[None]:
    """Item 2 of :func:`apply_cpu_compat`, scoped to model construction. A no-op with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[assignment]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelContext:
    """What a rank knows about the layout: sizes, ranks, groups and the device."""

    tp_size: int
    pp_size: int
    dp_size: int
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    pp_ranks: Sequence[int]
    """Global ranks of this rank's pipeline, first stage first."""
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    """Expert parallelism (ParallelConfig.expert_model_parallel_size): the data-parallel ranks that
    split a mixture of experts' routed experts between them."""
    expert_dp_rank: int = 0
    expert_dp_group: Optional[dist.ProcessGroup] = None
    """The ranks that hold the same experts (data-parallel size / EP of them): an expert's gradient
    is summed over these, every other parameter's over the whole data-parallel group."""
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    """ParallelConfig.num_layers_in_first/last_pipeline_stage (None: an even split)."""
    sequence_parallel: bool = False
    """ParallelConfig.sequence_parallel: the policy update splits activations over the TP ranks along
    the sequence (PolicyModel.sequence_parallel)."""
    _sends: list = field(default_factory=list, init=False, repr=False, compare=False)  # (work, tensor) in flight
    _step_start: Optional[int] = field(default=None, init=False, repr=False, compare=False)  # see forward_step

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage for a model of ``num_layers``, first stage first."""
        return pipeline_split(num_layers, self.pp_size, self.first_stage_layers, self.last_stage_layers)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # -- pipeline point-to-point (inference: hidden states flow first -> last stage) ----------
    def send_forward(self, tensor: torch.Tensor) -> None:
        """Send this stage's output hidden states [s, b, h] to the next stage."""
        dist.send(tensor.contiguous(), dst=self.pp_ranks[self.pp_rank + 1])

    def post_forward(self, tensor: torch.Tensor) -> None:
        """Send this stage's output on without waiting for the next stage to take it (inference).

        Rollouts interleave groups of responses over the stages (rollout/base.run_groups): a stage
        sends one group's output, runs the next group's forward and then meets the other stages in
        the first group's broadcast, while the next stage is still busy; a blocking send would wait
        for a receive that comes only after that broadcast. The sends before are waited for first
        (the next stage has long received them) but those of the same :meth:`forward_step`, and
        :meth:`flush_sends` waits for the last ones."""
        keep = len(self._sends) if self._step_start is None else self._step_start
        _wait(self._sends[:keep])
        self._sends = self._sends[keep:]
        if self._step_start is not None:
            self._step_start = 0
        entry = (dist.isend(tensor.contiguous(), dst=self.pp_ranks[self.pp_rank + 1]), tensor)
        self._sends.append(entry)
        _IN_FLIGHT[id(entry)] = entry

    @contextlib.contextmanager
    def forward_step(self) -> Iterator[None]:
        """A group-step's forwards (rollout/base.run_groups), whose sends stay in flight together: a step
        that prefills admitted prompts and then decodes sends twice, and the next stage receives both
        in its own step, which may come after this stage's next broadcast."""
        self._step_start = len(self._sends)
        try:
            yield
        finally:
            self._step_start = None

    def flush_sends(self) -> None:
        """Wait for the sends :meth:`post_forward` left in flight, if any."""
        _wait(self._sends)
        self._sends = []

    def recv_forward(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive the previous stage's hidden states."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(buf, src=self.pp_ranks[self.pp_rank - 1])
        return buf

    def send_backward(self, grad: torch.Tensor) -> None:
        """Send the gradient of this stage's input to the previous stage (training)."""
        dist.send(grad.contiguous(), dst=self.pp_ranks[self.pp_rank - 1])

    def recv_backward(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive the gradient of this stage's output from the next stage (training)."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(buf, src=self.pp_ranks[self.pp_rank + 1])
        return buf

    def send_forward_recv_backward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Send this stage's output on and receive the gradient of an earlier output (of ``shape``),
        both posted at once (the next stage does :meth:`send_backward_recv_forward`; two blocking
        sends would wait on each other)."""
        grad = torch.empty(tuple(shape), dtype=tensor.dtype, device=self.device)
        nxt = self.pp_ranks[self.pp_rank + 1]
        self._exchange([dist.P2POp(dist.isend, tensor.contiguous(), nxt), dist.P2POp(dist.irecv, grad, nxt)])
        return grad

    def send_backward_recv_forward(self, grad: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Send the gradient of this stage's input back and receive the next input, both at once."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        prev = self.pp_ranks[self.pp_rank - 1]
        self._exchange([dist.P2POp(dist.isend, grad.contiguous(), prev), dist.P2POp(dist.irecv, buf, prev)])
        return buf

    @staticmethod
    def _exchange(ops: list) -> None:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def broadcast_object_from_last_stage(self, obj: object) -> object:
        """A picklable object from the last stage to every stage of this pipeline."""
        if self.pp_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.pp_ranks[-1], group=self.pp_group)
        return holder[0]

    def _all_reduce(self, tensor: torch.Tensor, group: Optional[dist.ProcessGroup],
                    op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce. A tensor that lives off the communication device (a CPU counter
        under nccl) is reduced there and copied back."""
        if tensor.device == self.device:
            dist.all_reduce(tensor, op=op, group=group)
            return tensor
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, op=op, group=group)
        return tensor.copy_(on_device)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise max over every rank (all ranks agree on one measured profile)."""
        if self.world_size > 1:
            self._all_reduce(tensor, None, dist.ReduceOp.MAX)
        return tensor

    def gather_values(self, value: float) -> list[float]:
        """Every rank's ``value`` (a float64, exact for integers below 2 ** 53), in rank order: each
        rank's slot of a vector -inf elsewhere, max-reduced (one small all-reduce)."""
        values = torch.full((self.world_size,), -math.inf, dtype=torch.float64)
        values[self.rank] = value
        return self.all_reduce_max(values).tolist()

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (gradients, token counts)."""
        if self.dp_size > 1:
            self._all_reduce(tensor, self.dp_group)
        return tensor

    def all_reduce_pp(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.pp_size > 1:
            self._all_reduce(tensor, self.pp_group, getattr(dist.ReduceOp, op.upper()))
        return tensor

    def all_reduce_embedding_group(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the first and last pipeline stages (gradients of a tied embedding)."""
        from megatron.core import parallel_state as ps

        if self.pp_size > 1:
            self._all_reduce(tensor, ps.get_embedding_group())
        return tensor

    def broadcast_from_last_stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Give every stage the last stage's tensors (same shapes and dtypes on all stages)."""
        if self.pp_size == 1:
            return list(tensors)
        out = []
        for t in tensors:
            t = t.contiguous()
            dist.broadcast(t, src=self.pp_ranks[-1], group=self.pp_group)
            out.append(t)
        return out

    def all_reduce_ep(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Over the expert-parallel group (the ranks that split the experts)."""
        if self.ep_size > 1:
            self._all_reduce(tensor, self.ep_group, getattr(dist.ReduceOp, op.upper()))
        return tensor

    def all_reduce_expert_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold the same experts (an expert's gradient)."""
        if (group := self.grad_group(expert=True)) is not None:
            self._all_reduce(tensor, group)
        return tensor

    def grad_group(self, expert: bool) -> Optional[dist.ProcessGroup]:
        """The ranks a parameter's gradient is summed over: the data-parallel replicas, or for an expert
        split over expert-parallel ranks (``expert``) those that hold the same experts; None where that
        is this rank alone."""
        if expert:
            return self.expert_dp_group if self.dp_size > self.ep_size else None
        return self.dp_group if self.dp_size > 1 else None

    def all_gather_ep(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every EP rank's tensor (same shape on all), in EP rank order."""
        if self.ep_size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.ep_group)
        return parts

    # -- tensor parallel ------------------------------------------------------------------------
    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Concatenate vocab-parallel logits [..., V/tp] into the full padded vocabulary [..., V]."""
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def all_gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every TP rank's tensor (same shape): [tp, ...], in rank order."""
        if self.tp_size == 1:
            return tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.stack(parts)

    def all_reduce_tp(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.tp_size > 1:
            self._all_reduce(tensor, self.tp_group, getattr(dist.ReduceOp, op.upper()))
        return tensor

    def gather_to_rank0(self, items: list) -> list:
        """Concatenate each data-parallel rank's list on global rank 0 (others get an empty list)."""
        if self.dp_size == 1:
            return items if self.rank == 0 else []
        if self.tp_rank != 0 or self.pp_rank != 0:  # every (TP, PP) replica holds the same items
            return []
        parts: Optional[list] = [None] * self.dp_size if self.rank == 0 else None
        dist.gather_object(items, parts, dst=0, group=self.dp_group)
        return [x for p in parts for x in p] if parts is not None else []

    def all_gather_object_dp(self, obj: object) -> list:
        """Every data-parallel replica's picklable ``obj``, in replica order (the same list on all)."""
        if self.dp_size == 1:
            return [obj]
        parts: list = [None] * self.dp_size
        dist.all_gather_object(parts, obj, group=self.dp_group)
        return parts

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def initialize(parallel: ParallelConfig, model: Optional[ModelConfig] = None,
               timeout_minutes: int = 30) -> ParallelContext:
    """Initialise torch.distributed (from torchrun's environment, or a 1-process group) and
    megatron-core's model-parallel state. Validates the layout against ``model`` when given. Pipeline
    sends still in flight from an earlier context are waited for first (:func:`wait_for_sends`)."""
    from megatron.core import parallel_state as ps

    wait_for_sends()
    apply_cpu_compat()
    apply_megatron_compat()
    use_cuda = torch.cuda.is_available() and parallel.backend != "gloo"
    backend = parallel.backend or ("nccl" if use_cuda else "gloo")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Validate before any process group exists, so a bad layout fails fast and cleanly.
    model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    if model is not None:
        parallel.validate(model, world_size)
    elif world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({parallel.tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({parallel.pipeline_model_parallel_size})")
    elif (world_size // model_parallel) % parallel.expert_model_parallel_size:
        raise ValueError(f"the data-parallel size ({world_size // model_parallel}) is not divisible by "
                         f"expert_model_parallel_size ({parallel.expert_model_parallel_size})")

    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        init_method = None  # torchrun: MASTER_ADDR / MASTER_PORT from the environment
        if "MASTER_ADDR" not in os.environ:
            if world_size != 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set; launch with torchrun")
            # A private store for this process; the environment stays untouched, so child processes
            # (launched tools, tests) do not inherit a port that is already taken.
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, init_method=init_method,
                                timeout=datetime.timedelta(minutes=timeout_minutes))

    global _INITIALIZED
    layout = (dist.group.WORLD, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
              parallel.expert_model_parallel_size)
    # (the layout already set up here, as for another trainer or tool in this process: its groups kept)
    if not (ps.model_parallel_is_initialized() and _INITIALIZED == layout):
        if ps.model_parallel_is_initialized():
            _destroy_model_parallel()
        _INITIALIZED = layout
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            create_gloo_process_groups=False,
        )
    if use_cuda:
        # megatron-core initialises weights on the GPU inside its model-parallel RNG tracker, which
        # must hold a state first. Checkpoints overwrite these weights; the seed only makes a
        # randomly initialised model reproducible.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return context_from_parallel_state(device, parallel)


def context_from_parallel_state(device: torch.device, parallel: Optional[ParallelConfig] = None) -> ParallelContext:
    """Read megatron's parallel state into a ParallelContext (``parallel``: the uneven pipeline split,
    if any)."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    return ParallelContext(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(),
        pp_ranks=list(dist.get_process_group_ranks(pp_group)),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        first_stage_layers=parallel.num_layers_in_first_pipeline_stage if parallel is not None else None,
        last_stage_layers=parallel.num_layers_in_last_pipeline_stage if parallel is not None else None,
        sequence_parallel=parallel.sequence_parallel if parallel is not None else False,
    )


def grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient training reduces, clips and steps with: megatron's float32 ``main_grad`` where the
    parameter has one (bfloat16 parameters under :class:`specroll_mcore.optimizer.MainParamAdamW`),
    else ``.grad``."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def expert_parallel(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is split over expert-parallel ranks (a routed expert's weight under EP > 1:
    megatron-core's ``allreduce`` attribute, False for those)."""
    return not getattr(p, "allreduce", True)


def grad_sq_norm(params: Sequence[torch.nn.Parameter], ctx: ParallelContext, owned: bool = False) -> torch.Tensor:
    """Squared L2 norm of ``params``' gradients (:func:`grad_of`) over the TP and EP groups (float64):
    megatron's TP-sharded parameters (``tensor_model_parallel``) add up over the TP ranks, the experts
    split over EP ranks (:func:`expert_parallel`) over those, replicated ones count once. ``owned``:
    each gradient is held by one data-parallel replica, its owner under a sharded optimizer (the others
    dropped theirs): the sum then runs over the data-parallel group too, which holds the EP group."""
    sharded = torch.zeros((), dtype=torch.float64, device=ctx.device)
    experts = torch.zeros((), dtype=torch.float64, device=ctx.device)
    replicated = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for p in params:
        g = grad_of(p)
        if g is None:
            continue
        sq = torch.linalg.vector_norm(g, dtype=torch.float64).square()  # no float64 copy of the gradient
        if expert_parallel(p):
            experts += sq
        elif getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if owned:
        return ctx.all_reduce_dp(ctx.all_reduce_tp(sharded) + experts + replicated)
    return ctx.all_reduce_tp(sharded) + ctx.all_reduce_ep(experts) + replicated


def sum_grads(grads: Sequence[tuple[torch.Tensor, dist.ProcessGroup, Optional[int]]]) -> None:
    """Sum each gradient over its process group in place, all the collectives in flight at once, then
    waited for: onto every member (an all-reduce) or, with an owner (a global rank in the group), onto
    the owner alone (a reduce: the other members keep a partial sum, which they must not read)."""
    works = [dist.all_reduce(g, group=group, async_op=True) if owner is None
             else dist.reduce(g, dst=owner, group=group, async_op=True) for g, group, owner in grads]
    for w in works:
        w.wait()


def average_grads_dp(params: Sequence[torch.nn.Parameter], ctx: ParallelContext) -> None:
    """Replace each parameter's gradient (:func:`grad_of`) by its mean over the data-parallel replicas."""
    if ctx.dp_size > 1:
        for p in params:
            if (g := grad_of(p)) is not None:
                ctx.all_reduce_dp(g).div_(ctx.dp_size)


def clip_grads(params: Sequence[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale the gradients (:func:`grad_of`) whose global norm is ``norm`` down to ``max_norm``."""
    if norm > max_norm:
        for p in params:
            if (g := grad_of(p)) is not None:
                g.mul_(max_norm / (norm + 1e-6))


def destroy() -> None:
    """Tear down megatron's parallel state and the default process group, once the pipeline sends in
    flight have been received (:func:`wait_for_sends`)."""
    from megatron.core import parallel_state as ps

    wait_for_sends()
    global _INITIALIZED
    if ps.model_parallel_is_initialized():
        _destroy_model_parallel()
    _INITIALIZED = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _destroy_model_parallel() -> None:
    """megatron's ``destroy_model_parallel``, and first the process groups it created destroyed.
    Alone it only forgets them: each re-initialisation in one process (jobs in other layouts one
    after the other) would keep ~20 more groups, their sockets open, until the process runs out of
    file descriptors. The groups are those megatron lists as its own (``_global_process_group_list``,
    private; read, not changed; None there stands for the default group, destroyed by :func:`destroy`)."""
    from megatron.core import parallel_state as ps

    for group in getattr(ps, "_global_process_group_list", None) or ():
        if group is not None:
            dist.destroy_process_group(group)
    ps.destroy_model_parallel()
