"""Horizon heads: the root-token and draft-path inputs, and heads saved before them."""

import pytest
import torch

from specroll_mcore.config import tiny_llama
from specroll_mcore.model import PolicyModel


def test_root_features_are_rows_of_the_vocab_projection(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(model.root_features(ids), model.output_weight()[ids])


def test_heads_read_the_root_through_u_only(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    h = torch.randn(3, 64)
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    with torch.no_grad():
        assert torch.equal(model.head_logits(h, a), model.head_logits(h, b))  # U = 0: the root is ignored
        model.heads.root_layers[1].weight.normal_(std=0.1)
        la, lb = model.head_logits(h, a), model.head_logits(h, b)
    assert torch.equal(la[0], lb[0]) and not torch.allclose(la[1], lb[1])


def test_head_i_reads_the_first_i_path_tokens_through_v_only(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=3).eval()
    h, root = torch.randn(2, 64), torch.tensor([1, 2])
    a, b, c = torch.tensor([[4, 5], [6, 7]]), torch.tensor([[9, 5], [8, 7]]), torch.tensor([[4, 11], [6, 12]])
    assert [len(layers) for layers in model.heads.path_layers] == [0, 1, 2]
    with torch.no_grad():
        assert torch.equal(model.head_logits(h, root, path_ids=a), model.head_logits(h, root))  # V = 0
        for layers in model.heads.path_layers:
            for layer in layers:
                layer.weight.normal_(std=0.1)
        la, lb, lc = (model.head_logits(h, root, path_ids=x) for x in (a, b, c))
    assert torch.equal(la[0], lb[0]) and torch.equal(la[0], lc[0])  # head 1: no path
    assert not torch.allclose(la[1], lb[1]) and torch.equal(la[1], lc[1])  # head 2 reads path token 1 only
    assert not torch.allclose(la[2], lc[2])  # head 3 reads both


def test_heads_saved_without_root_layers_load_with_u_zero(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    with torch.no_grad():
        model.heads.root_layers[0].weight.fill_(1.0)
    w = {f"heads.layers.{i}.weight": torch.randn(64, 64) for i in range(2)}
    model.load_full_heads(w)  # the layout before root tokens: z = h + SiLU(W h)
    assert torch.equal(model.heads.layers[1].weight, w["heads.layers.1.weight"])
    assert all(layer.weight.abs().sum() == 0 for layer in model.heads.root_layers)
    assert all(layer.weight.abs().sum() == 0 for layers in model.heads.path_layers for layer in layers)
    with pytest.raises(ValueError, match="do not match this policy's heads"):
        model.load_full_heads({"heads.root_layers.0.weight": torch.zeros(64, 64)})  # W missing
    with pytest.raises(ValueError, match="do not match this policy's heads"):
        model.load_full_heads({**w, "heads.layers.2.weight": torch.zeros(64, 64)})  # a third head
