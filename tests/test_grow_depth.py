"""Depth growth (``vllm_diffusion_lab.training.depth_growth``, used by tools/grow_depth.py)
keeps the source model's function exactly, and only until training moves the new layers'
output projections."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from vllm_diffusion_lab.training.depth_growth import grow_state_dict, grown_layer_sources


def small_config(layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=128, tie_word_embeddings=False)


def test_layer_order_interleaves_new_layers_after_each_source_layer():
    assert grown_layer_sources(2, 2) == [0, None, None, 1, None, None]
    assert grown_layer_sources(4, 1) == [0, None, 1, None, 2, None, 3, None]


# (source layers, new layers after each source layer)
GRID = {"4_to_12": (4, 2), "2_to_4": (2, 1), "3_to_12": (3, 3)}


@pytest.mark.parametrize("source_layers,new_after_each", GRID.values(), ids=GRID.keys())
def test_grown_model_computes_the_source_logits(source_layers, new_after_each):
    torch.manual_seed(0)
    source = Qwen3ForCausalLM(small_config(source_layers)).double().eval()
    sources = grown_layer_sources(source_layers, new_after_each)
    grown = Qwen3ForCausalLM(small_config(len(sources))).double().eval()
    grown.load_state_dict(grow_state_dict(source.state_dict(), grown.state_dict(), sources))
    tokens = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        expected = source(input_ids=tokens).logits
        assert torch.allclose(grown(input_ids=tokens).logits, expected, atol=1e-10)
        # The new layers are live: once an output projection moves, the function changes.
        new_layer = sources.index(None)
        grown.model.layers[new_layer].self_attn.o_proj.weight.normal_(std=0.1)
        assert not torch.allclose(grown(input_ids=tokens).logits, expected, atol=1e-3)
