"""The SmolLM2 conversion's training layout and forward (``real_model/conversion.py``,
``layout.py``): the attention each copy sees, each target read once from the right row,
and the forward equal to transformers' Llama on a tiny random model built in code."""

from __future__ import annotations

import torch

from vllm_diffusion_lab.real_model.conversion import (MASK_TOKEN_ID, STOP_TOKEN_ID,
                                                      ConversionModel, LlamaShape,
                                                      merged_weights)
from vllm_diffusion_lab.real_model.layout import make_batch, padded_sequence, visibility


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return model, state, LlamaShape.from_config(config.to_dict())


def test_visibility_blocks():
    seen = visibility(8, 6, 4)  # 3 copies of 8 rows, 6 real, blocks of 4
    clean, noisy_a = slice(0, 8), slice(8, 16)
    assert seen[clean, clean][1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # its whole block
    assert seen[clean, clean][5].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]  # real keys only
    assert seen[noisy_a, clean][5].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # earlier blocks
    assert seen[noisy_a, noisy_a][5].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]  # own block
    assert not seen[8:16, 16:24].any() and not seen[0:8, 8:24].any()


def test_each_answer_token_is_one_target():
    tokens, start = padded_sequence(list(range(20, 26)), list(range(30, 40)) + [STOP_TOKEN_ID],
                                    4, 64)
    assert len(tokens) == 20 and tokens[-3:] == [STOP_TOKEN_ID] * 3 and start == 6
    batch = make_batch([(tokens, start)], 4, torch.Generator().manual_seed(1))
    length = 20
    targets = sorted(int(r) % length + 1 for r in batch.read_rows[:, 1])
    assert targets == list(range(start, len(tokens)))  # every answer position once
    for (_, row), target, clean in zip(batch.read_rows.tolist(), batch.targets.tolist(),
                                       batch.from_clean.tolist()):
        position = row % length + 1
        assert target == tokens[position]
        assert clean == (position % 4 == 0)  # block-first tokens from the clean copy
        if not clean:  # read from the copy where the position is a mask
            assert batch.ids[0, row + 1] == MASK_TOKEN_ID


def test_forward_equals_transformers_under_causal_mask():
    model, state, shape = tiny_llama()
    ours = ConversionModel(state, shape, rank=4)
    ids = torch.tensor([[3, 9, 27, 5, 11, 40, 2]])
    length = ids.shape[1]
    with torch.no_grad():
        logits = ours.logits(ours.hidden(ids, torch.arange(length)[None],
                                         torch.ones(length, length).tril().bool()[None]))
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def trained_looking_model(scale_norms: bool = False):
    """(state, shape, model): the tiny Llama's conversion model with random LoRA B factors
    (and, with ``scale_norms``, its norms times 1.1), as after some training."""
    _, state, shape = tiny_llama()
    ours = ConversionModel(state, shape, rank=4)
    with torch.no_grad():
        for p in ours.lora_b.values():
            p.normal_(0, 0.05)
        if scale_norms:
            for p in ours.norms.values():
                p.mul_(1.1)
    return state, shape, ours


def test_merge_equals_adapter_forward():
    state, shape, ours = trained_looking_model(scale_norms=True)
    merged = ConversionModel(merged_weights(state, ours.adapter_state(), ours.scale), shape,
                             rank=4)
    ids = torch.tensor([[3, MASK_TOKEN_ID % 64, 27, 5]])
    seen = torch.ones(4, 4).bool()[None]
    with torch.no_grad():
        a = ours.logits(ours.hidden(ids, torch.arange(4)[None], seen))
        b = merged.logits(merged.hidden(ids, torch.arange(4)[None], seen))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_stored_adapter_round_trip_is_within_int8_rounding():
    from vllm_diffusion_lab.real_model.converted import loaded_adapter, stored_adapter

    _, _, ours = trained_looking_model()
    adapter = ours.adapter_state()
    stored = stored_adapter(adapter)
    assert all(v.dtype == torch.int8 for k, v in stored.items() if k.startswith("lora"))
    back = loaded_adapter(stored)
    assert back.keys() == adapter.keys()
    for key, value in adapter.items():
        step = value.abs().amax(dim=1, keepdim=True) / 127 if key.startswith("lora") else 0
        assert ((back[key] - value).abs() <= step / 2 + 1e-7).all(), key
