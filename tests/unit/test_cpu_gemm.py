"""CPU inference products on packed weights equal the BLAS ones (float32 rounding), follow every
weight update, and are taken only where they apply: float32 inference of enough rows."""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_policy
from specroll_mcore import cpu_gemm
from specroll_mcore.config import tiny_llama, tiny_qwen2
from specroll_mcore.model import causal_mask


def test_packed_linear_equals_blas_and_follows_weight_updates():
    torch.manual_seed(0)
    w, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(2, 5, 64)
    cache = cpu_gemm.PackedWeight()
    with torch.inference_mode():
        assert cpu_gemm.applies(x, 4)
        torch.testing.assert_close(cpu_gemm.packed_linear(x, cache.get(w), bias), F.linear(x, w, bias))
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step or a checkpoint load: in place
        torch.testing.assert_close(cpu_gemm.packed_linear(x, cache.get(w)), F.linear(x, w))
    w = torch.randn(96, 64)  # a new tensor
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemm.packed_linear(x, cache.get(w)), F.linear(x, w))
        assert cache.get(torch.randn(96, 64)) is None  # an inference tensor: no version counter
        assert not cpu_gemm.applies(x[:, :1], 4)  # 2 rows
        assert not cpu_gemm.applies(x.double(), 4)
    assert not cpu_gemm.applies(x, 4)  # gradients enabled


def forward_logits(model, ids):
    meta = model.metadata(torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1),
                          causal_mask(ids.shape[0], ids.shape[1], ids.device))
    return model.full_logits(model(ids, meta))


@pytest.mark.parametrize("cfg", [tiny_llama(), tiny_qwen2()], ids=["llama", "qwen2_qkv_bias"])
def test_policy_forward_on_packed_weights_equals_blas(ctx, monkeypatch, cfg):
    """The whole policy, with packed products in every layer and in the vocab projection, against
    the same forward with them switched off (SPECROLL_PACKED_GEMM=0); one-token decode keeps BLAS
    and equals megatron's products (taken with gradients enabled)."""
    model = make_policy(cfg, ctx)
    calls = []
    real = cpu_gemm.packed_linear
    monkeypatch.setattr(cpu_gemm, "packed_linear", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    with torch.inference_mode():
        packed = forward_logits(model, ids)
        assert len(calls) == 4 * cfg.num_layers + 1  # qkv, proj, fc1, fc2 per layer; the vocab projection
        calls.clear()
        one_row = forward_logits(model, ids[:1, :1])
        assert not calls  # one row: BLAS (F.linear)
        monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
        blas = forward_logits(model, ids)
        assert not calls
    torch.testing.assert_close(packed, blas, rtol=1e-5, atol=1e-5)
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


def test_draft_vocab_projection_on_packed_rows():
    """The draft vocabulary's rows are packed once, when it is built (every rollout)."""
    from specroll_mcore.heads import DraftVocab

    torch.manual_seed(0)
    weight, z = torch.randn(300, 64), torch.randn(3, 1, 64)
    counts = torch.randint(0, 50, (300,))
    with torch.inference_mode():
        dv = DraftVocab.build(counts, 100, weight, 0)
        assert dv.packed is not None
        torch.testing.assert_close(dv.project(z), z @ dv.rows.t())
        assert DraftVocab.build(counts, 100, weight.double(), 0).packed is None
        assert DraftVocab.build(counts, 100, weight[:0], 300).packed is None  # a TP rank that owns none of the ids


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
    torch.testing.assert_close(trained[0].detach(), want_row[0])
