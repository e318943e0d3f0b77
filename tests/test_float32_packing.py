"""float32 projections through oneDNN's packing (model/layers/dense_linear.py): the products
stay float32, and the plain weight is held once, not beside its packed copy."""
import pytest
import torch

from pagedgen.settings import EngineConfig
from pagedgen.model.layers.linear import PackedWeight, linear, pack_weight
from pagedgen.model.layers.norm_mlp import GatedMLP
from pagedgen.model.layers.row_tiles import RowTiled
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner
from pagedgen.model.runtime.weight_bytes import weight_bytes
from tiny_models import tiny_model_dir

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="a torch build without oneDNN")


def _float64_linear(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_float32_weights_are_packed_for_onednn_and_multiplied_in_float32(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 160, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 160, generator=gen)
    packed = pack_weight(weight)
    assert packed.kind == "onednn"
    got = linear(x, weight, bias, packed)
    # float32 sums of 160 products: within ~1e-5 of float64; a bf16 product is ~1e-1 off.
    torch.testing.assert_close(got, _float64_linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def _random_mlp(hidden: int = 64, intermediate: int = 96) -> GatedMLP:
    mlp = GatedMLP(hidden, intermediate)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (mlp.gate_up_weight, mlp.down_weight):
            weight.copy_(torch.randn(weight.shape, generator=gen) / weight.shape[1] ** 0.5)
    return mlp


@needs_onednn
def test_packing_releases_the_plain_weight_and_survives_repacking():
    mlp = _random_mlp()
    x = torch.randn(9, 64)
    unpacked = mlp(x)
    mlp.pack_weights()
    assert mlp.gate_up_weight.device.type == "meta" and mlp.gate_up_weight.shape == (0, 64)
    assert mlp.down_weight.device.type == "meta" and mlp.down_weight.shape == (0, 96)
    assert isinstance(mlp.gate_up_packed, PackedWeight)
    torch.testing.assert_close(mlp(x), unpacked, rtol=1e-5, atol=1e-5)
    # Packing again (batch-invariant tiles, then back) keeps the packing the weight gave.
    mlp.pack_weights(row_tiled=True)
    assert isinstance(mlp.gate_up_packed, RowTiled)
    torch.testing.assert_close(mlp(x), unpacked, rtol=1e-5, atol=1e-5)
    mlp.pack_weights()
    assert isinstance(mlp.down_packed, PackedWeight)
    torch.testing.assert_close(mlp(x), unpacked, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_a_float32_model_holds_its_weights_once(tied):
    loaded = load_model(str(tiny_model_dir("llama", tied=tied)), dtype=torch.float32,
                        device="cpu")
    ModelRunner(loaded, EngineConfig(block_size=16, num_blocks=8))
    model = loaded.model
    config = model.config
    matrices = [config.vocab_size * config.hidden_size * (1 if tied else 2)]
    for layer in model.layers:
        matrices += [p.numel() for p in (layer.attention.qkv_packed.data,
                                         layer.attention.o_packed.data,
                                         layer.mlp.gate_up_packed.data, layer.mlp.down_packed.data)]
    vectors = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if t.dim() < 2
                  or t is model.rope)
    dense = 4 * (sum(matrices) + vectors)
    assert model.layers[0].attention.qkv_weight.device.type == "meta"
    assert model.embed_weight.device.type == "cpu"  # the look-ups read it
    assert model.is_tied == tied
    assert (model.lm_head_weight.device.type == "meta") == (not tied)
    held = weight_bytes(model)
    # Every matrix once; a tied head's table is the one matrix with a packed copy beside it.
    table = 4 * model.embed_weight.numel()
    assert held.total_bytes <= dense + (table if tied else 0)
    assert held.total_bytes >= dense
