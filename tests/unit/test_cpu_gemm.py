"""CPU inference products on packed weights (panels, oneDNN's layout) equal the BLAS ones (float32
rounding), follow every weight update, and are taken only where they apply: float32 inference."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import make_policy
from specroll_mcore import cpu_gemm
from specroll_mcore.checkpoint import random_full_state_dict
from specroll_mcore.config import tiny_llama, tiny_qwen2
from specroll_mcore.model import PolicyModel, causal_mask

needs_panels = pytest.mark.skipif(cpu_gemm.panel_kernels() is None,
                                  reason="panel kernels need AVX-512 and a C++ toolchain")


@pytest.mark.parametrize("panels", [True, False], ids=["panels", "onednn"])
@pytest.mark.parametrize("rows", [1, 3, 5, 13, 64, 65])
def test_packed_products_equal_blas_and_follow_weight_updates(monkeypatch, panels, rows):
    if panels and cpu_gemm.panel_kernels() is None:
        pytest.skip("panel kernels need AVX-512 and a C++ toolchain")
    if not panels:
        monkeypatch.setenv("SPECROLL_PANEL_GEMM", "0")
    torch.manual_seed(0)
    w, bias, x = torch.randn(100, 72), torch.randn(100), torch.randn(rows, 1, 72)
    packed = cpu_gemm.PackedWeight()
    packable = panels or rows >= cpu_gemm.LAYER_MIN_ROWS
    with torch.inference_mode():
        got = packed.product(x, w, cpu_gemm.LAYER_MIN_ROWS, bias)
        assert (got is not None) == packable
        if not packable:
            return
        torch.testing.assert_close(got, F.linear(x, w, bias))
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step or a checkpoint load: in place
    with torch.inference_mode():
        torch.testing.assert_close(packed.product(x, w, cpu_gemm.LAYER_MIN_ROWS), F.linear(x, w))
    w = torch.randn(100, 72)  # a new tensor
    with torch.inference_mode():
        torch.testing.assert_close(packed.product(x, w, cpu_gemm.LAYER_MIN_ROWS), F.linear(x, w))
        made_here = torch.randn(100, 72)  # an inference tensor: no version counter
        assert packed.product(x, made_here, cpu_gemm.LAYER_MIN_ROWS) is None
        frozen = cpu_gemm.PackedWeight(frozen=True)
        torch.testing.assert_close(frozen.product(x, made_here, cpu_gemm.LAYER_MIN_ROWS), F.linear(x, made_here))
        assert packed.product(x.double(), w.double(), cpu_gemm.LAYER_MIN_ROWS) is None
        assert packed.product(x, w[:0], cpu_gemm.LAYER_MIN_ROWS) is None  # a TP rank with no rows of it
    assert packed.product(x, w, cpu_gemm.LAYER_MIN_ROWS) is None  # gradients enabled
    monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
    with torch.inference_mode():
        assert packed.product(x, w, cpu_gemm.LAYER_MIN_ROWS) is None


@needs_panels
def test_panel_rows_do_not_depend_on_the_other_rows():
    """Each row of a panel product is bit for bit the same alone or with up to 40 others (odd sizes:
    outputs not a multiple of 16, inputs not a multiple of 16, rows with a stride), and close to BLAS."""
    kernels = cpu_gemm.panel_kernels()
    torch.manual_seed(0)
    w, big = torch.randn(37, 50), torch.randn(40, 80)
    panels = kernels.pack_panels(w)
    x = big[:, 10:60]  # rows with a stride of 80
    with torch.inference_mode():
        alone = torch.cat([kernels.panel_linear(x[i:i + 1], panels, 37) for i in range(40)])
        for n in range(1, 41):
            assert torch.equal(kernels.panel_linear(x[:n], panels, 37), alone[:n]), n
        torch.testing.assert_close(alone, F.linear(x, w))
        assert kernels.panel_linear(x[:0], panels, 37).shape == (0, 37)
        with pytest.raises(RuntimeError, match="pack the weight with pack_panels"):
            kernels.panel_linear(x, panels, 64)
        with pytest.raises(RuntimeError, match="float32"):
            kernels.pack_panels(w.double())


def test_a_failed_panel_build_warns_and_falls_back(monkeypatch):
    """No compiler (or any failed build): a warning that says what to do, and products on oneDNN's
    layout and BLAS, equal to the panels' up to rounding."""
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    cpu_gemm._build_panel_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"could not be built \(RuntimeError: .*c\+\+.*SPECROLL_PANEL_GEMM=0"):
            assert cpu_gemm.panel_kernels() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_gemm.panel_kernels() is None  # once per process
        torch.manual_seed(0)
        w, x = torch.randn(100, 72), torch.randn(8, 72)
        with torch.inference_mode():
            torch.testing.assert_close(cpu_gemm.PackedWeight().product(x, w, 4), F.linear(x, w))
            assert cpu_gemm.PackedWeight().product(x[:1], w, 4) is None
    finally:
        cpu_gemm._build_panel_kernels.cache_clear()


def test_a_killed_build_does_not_hang_later_processes(monkeypatch, tmp_path):
    """torch waits on a build lock with no time limit: a lock left by a killed build is removed (with
    a warning) before building; a fresh one (a build in progress in another process) is waited for
    until it goes, or until it is stale (that build was killed meanwhile)."""
    import os
    import threading
    import time

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    seen = []

    def fake_load(name, *args, **kwargs):
        lock = os.path.join(cpp_extension._get_build_directory(name, False), "lock")
        seen.append((name, os.path.exists(lock)))
        return "kernels"

    def build_with(lock_age_s=0.0, released_after_s=None):
        start = time.monotonic()  # (before the lock's time stamp: a wait until it is stale lasts that long)
        open(lock, "w").close()
        os.utime(lock, (time.time() - lock_age_s,) * 2)
        if released_after_s is not None:  # the other process's build ends
            threading.Timer(released_after_s, os.remove, (lock,)).start()
        cpu_gemm._build_panel_kernels.cache_clear()
        assert cpu_gemm._build_panel_kernels() == "kernels"
        assert seen[-1] == (name, False)  # torch found no lock to wait on
        return time.monotonic() - start

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cpu_gemm._build_panel_kernels.cache_clear()
    try:
        assert cpu_gemm._build_panel_kernels() == "kernels"
        name = seen[-1][0]
        lock = os.path.join(cpp_extension._get_build_directory(name, False), "lock")
        with pytest.warns(RuntimeWarning, match="removing a build lock left 60 minutes ago"):
            assert build_with(lock_age_s=3600) < 0.5
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert build_with(released_after_s=0.3) >= 0.3
        monkeypatch.setattr(cpu_gemm, "STALE_BUILD_LOCK_S", 0.4)
        with pytest.warns(RuntimeWarning, match="removing a build lock left 0 minutes ago"):
            assert build_with() >= 0.4  # its build was killed while this one waited
    finally:
        cpu_gemm._build_panel_kernels.cache_clear()


def forward_logits(model, ids):
    meta = model.metadata(torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1),
                          causal_mask(ids.shape[0], ids.shape[1], ids.device))
    return model.full_logits(model(ids, meta))


@pytest.mark.parametrize("cfg", [tiny_llama(), tiny_qwen2()], ids=["llama", "qwen2_qkv_bias"])
def test_policy_forward_on_packed_weights_equals_blas(ctx, monkeypatch, cfg):
    """The whole policy, with packed products in every layer and in the vocab projection (panels,
    then oneDNN's layout with SPECROLL_PANEL_GEMM=0), against the same forward with them switched
    off (SPECROLL_PACKED_GEMM=0); without panels one-token decode keeps BLAS and equals megatron's
    products (taken with gradients enabled)."""
    model = make_policy(cfg, ctx)
    calls = []
    for name in ("packed_linear", "panel_linear"):
        real = getattr(cpu_gemm, name)
        monkeypatch.setattr(cpu_gemm, name, lambda x, *a, _real=real, _name=name, **k: calls.append(_name) or
                            _real(x, *a, **k))
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    products = 4 * cfg.num_layers + 1  # qkv, proj, fc1, fc2 per layer; the vocab projection
    with torch.inference_mode():
        results = {}
        if cpu_gemm.panel_kernels() is not None:
            results["panels"] = forward_logits(model, ids)
            assert calls == ["panel_linear"] * products
            calls.clear()
            forward_logits(model, ids[:1, :1])
            assert calls == ["panel_linear"] * products
            calls.clear()
        monkeypatch.setenv("SPECROLL_PANEL_GEMM", "0")
        results["onednn"] = forward_logits(model, ids)
        assert calls == ["packed_linear"] * products
        calls.clear()
        one_row = forward_logits(model, ids[:1, :1])
        assert not calls  # one row: BLAS (F.linear)
        monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
        blas = forward_logits(model, ids)
        assert not calls
    for got in results.values():
        torch.testing.assert_close(got, blas, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_row, forward_logits(model, ids[:1, :1]).detach())  # megatron's own products


def test_training_and_float64_keep_megatron_products(ctx, monkeypatch):
    """With gradients the products are megatron's (they carry the backward); float64 is never packed."""
    calls = []
    monkeypatch.setattr(cpu_gemm, "packed_linear", lambda *a, **k: calls.append(1))
    model = make_policy(tiny_llama(), ctx)
    ids = torch.randint(0, 300, (2, 6))
    forward_logits(model, ids).sum().backward()
    assert not calls
    assert model.gpt.decoder.layers[0].mlp.linear_fc1.weight.grad is not None
    with torch.inference_mode():
        forward_logits(make_policy(tiny_llama(params_dtype="float64"), ctx), ids)
    assert not calls


def test_frozen_input_products_give_megatron_weight_gradients(ctx):
    """A product whose input needs no gradient (the heads' layers on the policy's hidden states)
    skips megatron's autograd function, whose backward also computes the input's gradient, and
    gives the same output and weight gradient as megatron's."""
    model = make_policy(tiny_llama(), ctx)
    layer = model.gpt.decoder.layers[0].mlp.linear_fc1
    x = torch.randn(5, layer.weight.shape[1])
    out = layer(x)[0]
    out.pow(2).sum().backward()
    ours = layer.weight.grad.clone()
    layer.weight.grad = None
    x_grad = x.clone().requires_grad_(True)  # an input with a gradient: megatron's function
    ref = layer(x_grad)[0]
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(ours, layer.weight.grad)
    assert x_grad.grad is not None
    assert "LinearWithGradAccumulation" in type(ref.grad_fn).__name__
    assert "LinearWithGradAccumulation" not in type(out.grad_fn).__name__


def test_pack_for_inference_repacks_updated_weights_before_the_forward(ctx, monkeypatch):
    """After an optimizer step, ``pack_for_inference`` makes every layout a forward of a few or of many
    rows takes (layers, heads, vocab projection), so the forwards that follow pack nothing; the
    products equal BLAS on the updated weights. Nothing is packed with packed products switched off."""
    cfg = tiny_llama()
    model = PolicyModel(cfg, ctx, num_heads=2).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, 0, std=0.08))
    packs = []
    real_pack = cpu_gemm.pack
    monkeypatch.setattr(cpu_gemm, "pack", lambda w: packs.append(tuple(w.shape)) or real_pack(w))
    layouts = ["onednn"] + (["panels"] if cpu_gemm.panel_kernels() is not None else [])
    layers = [m for m in model.modules() if isinstance(m, cpu_gemm._PackedForward)]
    assert len(layers) > 4 * model.config.num_layers  # the heads' layers too
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # an optimizer step: in place
    model.pack_for_inference()
    assert len(packs) == len(layers) + 1  # oneDNN's layout of every layer and of the vocab projection
    for m in layers + [None]:
        copies = (model._packed_vocab if m is None else m.packed_weight())._copies
        assert sorted(copies) == layouts
    packs.clear()
    ids = torch.randint(0, 300, (2, 40))  # 80 rows: oneDNN's layout; then one row: panels (or BLAS)
    with torch.inference_mode():
        got = [forward_logits(model, ids), forward_logits(model, ids[:1, :1])]
    assert not packs
    monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
    with torch.inference_mode():
        torch.testing.assert_close(got[0], forward_logits(model, ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], forward_logits(model, ids[:1, :1]), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.gpt.decoder.layers[0].mlp.linear_fc1.weight.mul_(2.0)
    model.pack_for_inference()
    assert not packs


def test_draft_vocab_projection_on_packed_rows():
    """The draft vocabulary's rows (built under inference mode, at a rollout start) are packed on first use."""
    from specroll_mcore.heads import DraftVocab

    torch.manual_seed(0)
    weight, z = torch.randn(300, 64), torch.randn(3, 1, 64)
    counts = torch.randint(0, 50, (300,))
    with torch.inference_mode():
        dv = DraftVocab.build(counts, 100, weight, 0)
        torch.testing.assert_close(dv.project(z), z @ dv.rows.t())
        assert dv.packed._copies  # packed
        dv64 = DraftVocab.build(counts, 100, weight.double(), 0)
        torch.testing.assert_close(dv64.project(z.double()), z.double() @ dv64.rows.t())
        assert not dv64.packed._copies
        none = DraftVocab.build(counts, 100, weight[:0], 300)  # a TP rank that owns none of the ids
        assert none.project(z).shape == (3, 1, 0) and not none.packed._copies


@pytest.mark.parametrize("skip_bias_add", [False, True])
@pytest.mark.parametrize("gather_output", [False, True])
def test_inference_forward_skips_megatron_regions_and_equals_megatron_forward(ctx, monkeypatch, skip_bias_add,
                                                                             gather_output):
    """In CPU inference the linears' forwards leave out megatron's TP-region functions (identities at
    TP=1; the TP=2 layout tests cover the communicating ones) and return what megatron's forwards
    return, bias handling included; with gradients they are megatron's forwards."""
    import megatron.core.tensor_parallel.layers as layers
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = make_policy(tiny_llama(), ctx).gpt.config
    torch.manual_seed(0)
    col = cpu_gemm.PackedColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.normal_, bias=True,
                                              gather_output=gather_output, skip_bias_add=skip_bias_add)
    row = cpu_gemm.PackedRowParallelLinear(96, 64, config=config, init_method=torch.nn.init.normal_, bias=True,
                                           input_is_parallel=True, skip_bias_add=skip_bias_add)
    for p in (col.bias, row.bias):
        torch.nn.init.normal_(p)
    x = torch.randn(5, 1, 64)
    with torch.inference_mode():
        want_col = ColumnParallelLinear.forward(col, x)
        want_row = RowParallelLinear.forward(row, want_col[0])
    regions = []
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                 "gather_from_tensor_model_parallel_region"):
        real = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda t, *a, _real=real, _name=name, **k: regions.append(_name) or
                            _real(t, *a, **k))
    with torch.inference_mode():
        got_col, got_row = col(x), row(want_col[0])
    assert not regions
    for got, want in ((got_col, want_col), (got_row, want_row)):
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None) == (not skip_bias_add)
    trained = row(col(x)[0])  # gradients: megatron's forwards, regions included
    assert trained[0].grad_fn is not None and regions
    # (outputs of ~80 from N(0, 1) weights: another kernel's summation order moves them by ~1e-5)
    torch.testing.assert_close(trained[0].detach(), want_row[0], rtol=1e-5, atol=1e-4)


def test_inference_off_cpu_skips_megatron_autograd_functions(ctx, monkeypatch):
    """Off the CPU (here the meta device, standing in for a GPU) inference takes the same lean forwards:
    F.linear without megatron's TP-region functions, its autograd linear function or its output
    layer, the host's cost of every linear where a GPU forward is bound by the host (1.6x faster
    SmolLM2-shaped forwards on an H200, docs/results/gpu_h200_lean_inference_linear.json)."""
    import megatron.core.tensor_parallel.layers as layers

    def refused(*a, **k):
        raise AssertionError("megatron's training path in inference")

    policy = make_policy(tiny_llama(), ctx)
    config = policy.gpt.config
    col = cpu_gemm.PackedColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.normal_, bias=True,
                                              gather_output=False).to("meta")
    row = cpu_gemm.PackedRowParallelLinear(96, 64, config=config, init_method=torch.nn.init.normal_, bias=True,
                                           input_is_parallel=True, skip_bias_add=False).to("meta")
    policy.to("meta")
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                 "linear_with_grad_accumulation_and_async_allreduce"):
        monkeypatch.setattr(layers, name, refused)
    monkeypatch.setattr(policy.gpt.output_layer, "forward", refused)
    x = torch.empty(5, 1, 64, device="meta")
    with torch.inference_mode():
        hidden, _ = col(x)
        out, _ = row(hidden)
        logits = policy.vocab_projection(torch.empty(3, 1, policy.config.hidden_size, device="meta"))
    assert (hidden.shape, out.shape, logits.shape) == ((5, 1, 96), (5, 1, 64), (3, 1, policy.padded_vocab_size))
    with pytest.raises(AssertionError, match="training path"):  # gradients: megatron's forwards
        col(torch.empty(5, 1, 64, device="meta", requires_grad=True))
