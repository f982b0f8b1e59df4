"""``HSTUConfig.layer_style``: "ours" is the default and unchanged; "reference" builds and
initialises each layer as the open-source HSTU does (no f1 bias, plain LayerNorms, its inits)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig

SHAPE = {"num_items": 300, "dim": 50, "num_layers": 2, "num_heads": 1, "max_seq_len": 200}


def _model(style: str, seed: int = 0) -> HSTU:
    torch.manual_seed(seed)
    return HSTU(HSTUConfig(**SHAPE, layer_style=style))  # type: ignore[arg-type]


def test_ours_is_the_default_and_keeps_its_parameters() -> None:
    assert HSTUConfig(num_items=3).layer_style == "ours"
    layer = _model("ours").blocks[0]
    assert layer.f1.bias is not None and not layer.f1.bias.any()
    assert not layer.f2.bias.any() and not layer.pos_w.any() and not layer.time_w.any()
    for norm in (layer.norm_in, layer.norm_attn):
        assert norm.elementwise_affine and norm.eps == 1e-5
    with pytest.raises(ConfigError, match="layer_style must be one of"):
        HSTUConfig(num_items=3, layer_style="meta")


def test_reference_layers_drop_the_f1_bias_and_the_norms_affine_parameters() -> None:
    ours, reference = _model("ours").state_dict(), _model("reference").state_dict()
    dropped = {f"layers.{i}.{name}" for i in range(2)
               for name in ("f1.bias", "norm_in.weight", "norm_in.bias", "norm_attn.weight",
                            "norm_attn.bias")}
    assert set(ours) - set(reference) == dropped and set(reference) <= set(ours)
    for name, tensor in reference.items():       # every kept parameter keeps its shape
        assert tensor.shape == ours[name].shape, name
    with pytest.raises(RuntimeError, match="Unexpected key"):
        _model("reference").load_state_dict(ours)


def test_reference_norms_standardise_without_affine_and_eps_1e6() -> None:
    layer = _model("reference").blocks[0]
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(1)) * 1e-3
    expected = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False,
                                                                 keepdim=True) + 1e-6)
    for norm in (layer.norm_in, layer.norm_attn):
        assert not list(norm.parameters())
        torch.testing.assert_close(norm(x), expected)
    # the projections then read U, V, Q, K from the standardised token alone
    u, v, q, k = layer.project(x)
    uvqk = F.silu(expected @ layer.f1.weight.t())
    torch.testing.assert_close(torch.cat([u, v, q, k], -1), uvqk)


def test_reference_initialisation_follows_the_open_source_hstu() -> None:
    model = _model("reference")
    rows, dim = SHAPE["max_seq_len"] + 1, SHAPE["dim"]
    # xavier-normal of the [201, 50] position table: std sqrt(2 / (201 + 50))
    assert model.pos_emb.weight.std().item() == pytest.approx(math.sqrt(2 / (rows + dim)),
                                                              rel=0.05)
    bound = 1 / math.sqrt(dim)
    for layer in model.blocks:
        assert layer.f1.bias is None
        assert layer.f1.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert layer.f1.weight.mean().abs().item() < 0.002
        # f2: xavier-uniform weight (bound sqrt(6 / (d + d))), PyTorch's default bias
        assert layer.f2.weight.abs().max().item() <= math.sqrt(6 / (2 * dim))
        assert layer.f2.bias.abs().max().item() <= bound
        assert layer.f2.bias.abs().max().item() > bound / 2
        assert layer.pos_w.std().item() == pytest.approx(0.02, rel=0.15)
        assert layer.time_w.std().item() == pytest.approx(0.02, rel=0.4)   # 64 weights
        assert layer.time_w.any() and layer.pos_w.any()

