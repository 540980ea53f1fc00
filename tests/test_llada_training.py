"""The LLaDA-format model of ``vllm_diffusion_lab.training.llada_format`` (trained by
tools/train_llada.py): SDAR weights land under LLaDA's published names, the network is
the Llama-style one (checked against transformers' Llama under a causal mask; it attends
fully without one), the 9-layer shape fits the 16 MB checkpoint limit, LLaDA's SFT objective
masks only the response and weights by 1/t, and the decoding loop runs its step count."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from vllm_diffusion_lab.training import llada_format

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZE_LIMIT_BYTES = 16_000_000
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False)
SDAR = {**SHAPE, "mask_token_id": 3, "pad_token_id": 0}


def tiny_llada(layers: int = 2, seed: int = 0) -> llada_format.LLaDAModelLM:
    torch.manual_seed(seed)
    return llada_format.LLaDAModelLM(llada_format.config_from_sdar(SDAR, layers)).double().eval()


def test_sdar_weights_land_under_the_published_names():
    torch.manual_seed(0)
    sdar = Qwen3ForCausalLM(Qwen3Config(**SHAPE, num_hidden_layers=4)).state_dict()
    converted = llada_format.sdar_to_llada(sdar, [0, 2, 3])
    expected = tiny_llada(3).state_dict()
    assert set(converted) == set(expected)
    assert all(converted[name].shape == expected[name].shape for name in expected)
    prefix = "model.transformer."
    assert {"wte.weight", "ln_f.weight", "ff_out.weight", "blocks.2.attn_out.weight",
            "blocks.0.ff_proj.weight", "blocks.0.up_proj.weight"} <= {n[len(prefix):] for n in converted}
    assert converted[prefix + "blocks.1.q_proj.weight"] is sdar["model.layers.2.self_attn.q_proj.weight"]
    assert converted[prefix + "blocks.1.ff_proj.weight"] is sdar["model.layers.2.mlp.gate_proj.weight"]
    assert converted[prefix + "blocks.2.ff_out.weight"] is sdar["model.layers.3.mlp.down_proj.weight"]
    assert converted[prefix + "ff_out.weight"] is sdar["lm_head.weight"]
    assert not any("norm" in n and ("q_" in n or "k_" in n) for n in converted)  # q/k norms dropped


def test_config_has_the_published_keys():
    config = llada_format.config_from_sdar(SDAR, 3)
    assert config["model_type"] == "llada" and config["architectures"] == ["LLaDAModelLM"]
    assert config["block_type"] == "llama" and config["layer_norm_type"] == "rms"
    assert not config["weight_tying"] and not config["attention_layer_norm"]
    assert (config["d_model"], config["n_heads"], config["n_kv_heads"], config["n_layers"],
            config["mlp_hidden_size"], config["embedding_size"]) == (32, 4, 2, 3, 48, 64)
    assert (config["mask_token_id"], config["eos_token_id"], config["pad_token_id"]) == (3, 0, 0)


def test_network_is_llama_without_the_causal_mask():
    """Same weights as a transformers Llama: equal logits under a causal mask; without one
    every position sees the later ones."""
    torch.manual_seed(1)
    llama = LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=2, attention_bias=False,
                                         mlp_bias=False)).double().eval()
    for parameter in llama.parameters():  # norms away from 1, so that they are checked too
        if parameter.ndim == 1:
            parameter.data.normal_(1.0, 0.3)
    model = tiny_llada(2)
    model.load_state_dict(llada_format.sdar_to_llada(llama.state_dict(), [0, 1]))
    ids = torch.randint(0, 64, (2, 19))
    causal = torch.ones(19, 19, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        expected = llama(input_ids=ids).logits
        assert torch.allclose(model(ids, attention_mask=causal), expected, atol=1e-5)
        assert not torch.allclose(model(ids)[:, 0], expected[:, 0], atol=1e-3)


def test_default_shape_fits_the_size_limit_and_saves_in_bfloat16(tmp_path):
    sdar = json.loads((REPO / "checkpoints/sdar-small-chat/config.json").read_text())
    config = llada_format.config_from_sdar(sdar, 9)
    with torch.device("meta"):
        params = sum(p.numel() for p in llada_format.LLaDAModelLM(config).parameters())
    assert 2 * params < SIZE_LIMIT_BYTES - 100_000
    model = tiny_llada(2)
    llada_format.save_checkpoint(model.state_dict(), llada_format.config_from_sdar(SDAR, 2),
                                 REPO / "checkpoints/sdar-small-chat", tmp_path, end_of_turn_id=2)
    tiny_params = sum(p.numel() for p in model.parameters())
    assert 2 * tiny_params < (tmp_path / "model.safetensors").stat().st_size < 2 * tiny_params + 10_000
    assert (tmp_path / "chat_template.jinja").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    for path in (REPO / "checkpoints").glob("llada*/model.safetensors"):
        assert path.stat().st_size <= SIZE_LIMIT_BYTES, path


def test_sft_rows_pad_the_response_with_eos_to_the_canvas():
    ids, prompt_lengths = llada_format.sft_batch([([5, 6, 7], [8, 9, 2]), ([5, 6], [8, 2])],
                                                 canvas=6, eos_id=0)
    assert prompt_lengths.tolist() == [3, 2]
    assert ids.tolist() == [[5, 6, 7, 8, 9, 2, 0, 0, 0], [5, 6, 8, 2, 0, 0, 0, 0, 0]]


def test_sft_loss_masks_only_the_response_and_weights_by_inverse_ratio():
    model = tiny_llada(2)
    items = [([5, 6, 7, 8, 9], [10, 11, 2]), ([5, 6], [12, 13, 14, 2]), ([7] * 9, [15, 2])]
    ids, prompt_lengths = llada_format.sft_batch(items, canvas=8, eos_id=0)
    response = torch.arange(ids.shape[1])[None] >= prompt_lengths[:, None]
    answer_lengths = response.sum(1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        loss, info = llada_format.sft_loss(model, ids, prompt_lengths, mask_id=3, eps=1e-3,
                                           generator=generator)
        masked = info["masked"]
        assert not (masked & ~response).any()
        rows = masked.nonzero()[:, 0]
        ratio = 1.0 / (info["weight"] * answer_lengths[rows])  # the row's masking ratio t
        assert ((ratio >= 1e-3 - 1e-9) & (ratio <= 1 + 1e-9)).all()
        for row in range(3):  # one ratio per sequence
            assert torch.allclose(ratio[rows == row], ratio[rows == row][:1].expand(int((rows == row).sum())))
        assert torch.isclose(loss, (info["ce"] * info["weight"]).sum() / 3)
    # eps = 1: t = 1, every response position masked, loss = mean over rows of per-row mean CE
    loss, info = llada_format.sft_loss(model, ids, prompt_lengths, mask_id=3, eps=1.0,
                                       generator=generator)
    assert torch.equal(info["masked"], response)
    with torch.no_grad():
        logits = model(ids.masked_fill(response, 3))
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    per_row = (ce * response).sum(1) / answer_lengths
    assert torch.isclose(loss.double(), per_row.mean(), atol=1e-5)


@pytest.mark.parametrize("steps", [32, 16])
def test_decoding_runs_the_published_step_count(steps):
    model = tiny_llada(2)
    calls = []

    def count_and_never_predict_the_mask(module, inputs, logits):
        calls.append(1)
        return logits.index_fill(-1, torch.tensor([3]), -1e9)

    model.register_forward_hook(count_and_never_predict_the_mask)
    canvas = llada_format.generate(model, [5, 6, 7], mask_id=3, gen_length=32, block_length=8,
                                   steps=steps)
    assert len(canvas) == 32 and 3 not in canvas
    assert len(calls) == steps
