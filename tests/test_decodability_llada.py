"""``benchmarks/decodability_llada.py`` on a random tiny LLaDA-format model: its decoding loop
is LLaDA's (same canvas as ``llada_format.generate``, one commit per step), the recorded
candidates are the current block's masked positions, and the recorded importance is
``candidate_importance`` of q/k computed here independently (after RoPE)."""

from __future__ import annotations

import importlib
import math
import pathlib
import sys

import torch
from vllm_diffusion_lab.training import llada_format

from vllm_diffusion.kernels.importance import candidate_importance

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
decodability_llada = importlib.import_module("decodability_llada")

SDAR = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "mask_token_id": 3, "pad_token_id": 0}
MASK, PROMPT, GEN, BLOCK = 3, [5, 6, 7, 9, 11], 16, 4


def tiny_llada() -> llada_format.LLaDAModelLM:
    torch.manual_seed(0)
    model = llada_format.LLaDAModelLM(llada_format.config_from_sdar(SDAR, 2)).double().eval()
    for block in model.model.transformer.blocks:  # peaked attention: importances far apart
        block.q_proj.weight.data *= 20
        block.k_proj.weight.data *= 20
    model.register_forward_hook(  # never predict the mask (a random model may)
        lambda module, inputs, logits: logits.index_fill(-1, torch.tensor([MASK]), -1e9))
    return model


def layer_qk(model, ids: torch.Tensor, layer: int):
    """q [L, H, D], k [L, H_kv, D] after RoPE at ``layer``, by an explicit forward."""
    config, blocks = model.config, model.model.transformer.blocks
    heads, kv_heads = config["n_heads"], config["n_kv_heads"]
    dim = config["d_model"] // heads
    positions = torch.arange(ids.shape[1], dtype=torch.float64)
    inv_freq = config["rope_theta"] ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)  # [L, D]
    cos, sin = angles.cos(), angles.sin()
    x = model.model.transformer.wte(ids)
    for block in blocks[:layer]:
        x = block(x, cos.float(), sin.float(), None)
    normed = blocks[layer].attn_norm(x)[0]

    def rope(t):  # [L, n, D]
        first, second = t.chunk(2, dim=-1)
        return t * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None]

    q = rope(blocks[layer].q_proj(normed).view(-1, heads, dim))
    k = rope(blocks[layer].k_proj(normed).view(-1, kv_heads, dim))
    return q, k, 1 / math.sqrt(dim)


def test_records_follow_llada_decoding_and_focus_importance():
    model = tiny_llada()
    canvas, records = decodability_llada.decode_recording(model, PROMPT, mask_id=MASK,
                                                          gen_length=GEN, block_length=BLOCK)
    assert canvas == llada_format.generate(model, PROMPT, mask_id=MASK, gen_length=GEN,
                                           block_length=BLOCK)
    assert len(records) == GEN and MASK not in canvas
    start, committed = len(PROMPT), []
    for step, record in enumerate(records):
        block_start = start + (step // BLOCK) * BLOCK
        expected = [p for p in range(block_start, block_start + BLOCK) if p not in committed]
        assert record["positions"] == expected  # the block's masked positions, in order
        assert sum(record["decoded"]) == 1
        committed.append(record["positions"][record["decoded"].index(True)])
        assert len(record["layer0"]) == len(record["layer1"]) == len(expected)
        assert torch.allclose(torch.tensor(record["delta"]),
                              torch.tensor(record["layer1"]) - torch.tensor(record["layer0"]))
    assert sorted(committed) == list(range(start, start + GEN))

    step = BLOCK + 1  # the second step of the second block: some of it, a block before it, decoded
    ids = torch.tensor([PROMPT + [MASK] * GEN])
    for position in committed[:step]:
        ids[0, position] = canvas[position - start]
    candidates = torch.tensor(records[step]["positions"])
    assert ((ids[0] == MASK).nonzero()[:, 0][:len(candidates)] == candidates).all()
    for layer in (0, 1):
        with torch.no_grad():
            q, k, scale = layer_qk(model, ids, layer)
            expected = candidate_importance(q[candidates], k[candidates], scale, 3)
        recorded = torch.tensor(records[step][f"layer{layer}"], dtype=torch.float64)
        assert torch.allclose(recorded, expected.double(), atol=1e-5)
