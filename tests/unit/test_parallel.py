"""The megatron-core CPU compatibility items and the single-process context."""

import pytest
import torch

from specroll_mcore import parallel


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility only applies without CUDA")
def test_cpu_compat_items(ctx):
    assert parallel.apply_cpu_compat() == ["torch.cuda.current_device -> cpu",
                                           "MoEAlltoAllTokenDispatcher: no CUDA stream, split sizes to host arrays "
                                           "without one"]
    assert torch.cuda.current_device() == torch.device("cpu")
    # megatron's TP mappings allocate on torch.cuda.current_device(): they must run on CPU.
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    x = torch.randn(2, 3)
    assert torch.equal(gather_from_tensor_model_parallel_region(x), x)
    original = torch.Tensor.cuda
    with parallel.cpu_model_construction():
        assert x.cuda() is x
    assert torch.Tensor.cuda is original
    with pytest.raises((AssertionError, RuntimeError)):
        x.cuda()  # outside model construction, CUDA calls still fail loudly


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility only applies without CUDA")
def test_cpu_compat_all_to_all_dispatcher(ctx):
    """Item 3: megatron-core's all-to-all token dispatcher builds without a CUDA stream, and at its copy
    point (only there) its split sizes become the host arrays it hands to the all-to-all; the
    dispatcher itself runs at EP=2 in tests/dist/test_expert_parallel.py."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    parallel.apply_cpu_compat()
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None  # (megatron-core makes one when None)
    state = SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_permutation_1", output_splits_tp=None,
                            input_splits=torch.tensor([3, 1]), output_splits=torch.tensor([2, 2]))
    tokens = torch.tensor([4, 0])
    assert MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(state, "before_ep_alltoall", tokens) is tokens
    assert torch.is_tensor(state.input_splits)  # not the copy point: unchanged
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(state, "before_permutation_1", tokens)
    assert state.input_splits.tolist() == [3, 1] and not torch.is_tensor(state.input_splits)
    assert state.output_splits.tolist() == [2, 2] and state.output_splits_tp is None


def test_megatron_compat_items(ctx):
    """Without Transformer Engine, megatron-core 0.16's router gating product names an undefined
    te_general_gemm (0.17 and later define it as None themselves); once defined, a mixture-of-experts
    router runs on torch.mm."""
    from megatron.core.package_info import MAJOR, MINOR
    from megatron.core.transformer.moe import moe_utils

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        needed = (int(MAJOR), int(MINOR)) < (0, 17)
        assert parallel.apply_megatron_compat() == (["moe_utils.te_general_gemm -> None"] if needed else [])
        assert moe_utils.te_general_gemm is None
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    assert torch.allclose(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)


def test_single_process_context(ctx):
    assert (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.world_size) == (1, 1, 1, 1)
    assert ctx.is_first_stage and ctx.is_last_stage
    t = torch.arange(4)
    assert ctx.broadcast_from_last_stage([t])[0] is t
    assert ctx.gather_vocab(t) is t


def test_initialising_the_layout_again_keeps_its_process_groups(ctx):
    """A trainer or tool after another in one process: the same groups, none created (megatron-core's
    own re-initialisation would leave the old ones open; other layouts: tests/dist/test_process_groups.py)."""
    import torch.distributed as dist

    from specroll_mcore.config import ParallelConfig

    first = parallel.initialize(ParallelConfig())
    groups = len(dist.distributed_c10d._world.pg_map)
    again = parallel.initialize(ParallelConfig())
    assert (again.tp_group, again.pp_group, again.dp_group) == (first.tp_group, first.pp_group, first.dp_group)
    assert len(dist.distributed_c10d._world.pg_map) == groups


def test_megatron_compiles_deferred_to_a_kernels_first_call():
    """In a new interpreter, importing our model imports megatron-core with its fused kernels'
    torch.compile wrappers made at their first call (every fusion is off in our layers), and so, on
    megatron-core 0.16, without TorchDynamo. (0.17 and later also decorate an inference router's
    methods with torch.compile itself, which imports TorchDynamo as the class is defined.)"""
    import subprocess
    import sys

    from megatron.core.package_info import MAJOR, MINOR

    code = ("import sys, specroll_mcore.model, megatron.core.jit as jit; from specroll_mcore import parallel; "
            "print(jit.jit_fuser is parallel.compile_on_first_call, 'torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    deferred, dynamo = proc.stdout.split()
    assert deferred == "True", proc.stdout
    if (int(MAJOR), int(MINOR)) < (0, 17):
        assert dynamo == "False", proc.stdout


def test_compile_on_first_call_compiles_once_at_the_first_call(monkeypatch):
    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda x: fn(x) + 1  # (marks the compiled kernel's results)

    monkeypatch.setattr(torch, "compile", fake_compile)

    def kernel(x):
        return 2 * x

    fused = parallel.compile_on_first_call(kernel)
    assert compiled == [] and fused.__name__ == "kernel"
    assert fused(3) == 7 and fused(4) == 9 and compiled == [kernel]


def test_defer_megatron_compiles_where_megatron_core_was_imported_first(monkeypatch):
    """Applied after megatron-core's import (a program that imported it first): its jit_fuser is
    swapped from then on; a jit_fuser megatron-core set to something else is left alone."""
    import sys

    import megatron.core.jit as jit

    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, parallel._DeferredJitFuser)])
    monkeypatch.setattr(jit, "jit_fuser", torch.compile)
    assert parallel.defer_megatron_compiles() == ["megatron.core.jit.jit_fuser -> torch.compile at a kernel's "
                                                  "first call"]
    assert jit.jit_fuser is parallel.compile_on_first_call
    assert parallel.defer_megatron_compiles() == ["megatron.core.jit.jit_fuser -> torch.compile at a kernel's "
                                                  "first call"]  # (idempotent)
    monkeypatch.setattr(jit, "jit_fuser", jit.noop_decorator)  # (megatron.core.jit.disable_jit_fuser)
    assert parallel.defer_megatron_compiles() == [] and jit.jit_fuser is jit.noop_decorator
