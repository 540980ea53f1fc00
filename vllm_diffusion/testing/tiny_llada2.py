"""Tiny, seeded LLaDA2 (``llada2_moe``) checkpoints in the published layout, for tests.

``build_tiny_llada2(path)`` writes ``config.json`` with the published field names (no
``mask_token_id`` and no ``block_size``, as real LLaDA2 checkpoints), ``model.safetensors``
(float32, the published weight names: ``model.word_embeddings``,
``attention.query_key_value``, ``mlp.gate.expert_bias``, ...) and a byte-level BPE
tokenizer whose ``<|mask|>`` is an ordinary added token (not the tokenizer's
``mask_token``) and whose chat template is Ling's (``<role>HUMAN</role>...<|role_end|>``).
The first ``first_k_dense_replace`` layers are dense, the others mixture of experts with
group-limited routing and a shared expert; the expert bias is random so that selection
and weighting differ.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file

from vllm_diffusion.testing.tiny_sdar import (DEFAULT_EMBED_STD, DEFAULT_LM_HEAD_STD,
                                              DEFAULT_WEIGHT_STD, NORM_WEIGHT_JITTER,
                                              train_bpe)

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
ROLE_TOKENS = ("<role>", "</role>", "<|role_end|>")
LING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set role = {'user': 'HUMAN', 'assistant': 'ASSISTANT', 'system': 'SYSTEM'}"
    "[message['role']] %}"
    "{{ '<role>' + role + '</role>' + message['content'] + '<|role_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{%- endif %}"
)


def build_ling_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe((EOS_TOKEN, MASK_TOKEN) + ROLE_TOKENS),
        eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, extra_special_tokens=list(ROLE_TOKENS),
        chat_template=LING_TEMPLATE, model_max_length=2048)


def build_tiny_llada2(path: str | pathlib.Path, *, num_layers: int = 3, hidden_size: int = 64,
                      num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                      num_experts: int = 8, n_group: int = 4, topk_group: int = 2,
                      top_k: int = 2, first_k_dense_replace: int = 1, use_bias: bool = True,
                      seed: int = 0, max_position_embeddings: int = 2048) -> pathlib.Path:
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_ling_tokenizer()
    tokenizer.save_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "vocab_size": len(tokenizer), "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "use_qkv_bias": False,
        "use_qk_norm": True, "use_bias": use_bias, "rms_norm_eps": 1e-6, "norm_head": False,
        "tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings,
        "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "rotary_dim": head_dim,
        "num_experts": num_experts, "num_shared_experts": 1, "num_experts_per_tok": top_k,
        "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": 2.5,
        "moe_intermediate_size": hidden_size // 2,
        "first_k_dense_replace": first_k_dense_replace, "norm_topk_prob": True,
        "score_function": "sigmoid", "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True, "pad_token_id": eos, "eos_token_id": eos,
        "bos_token_id": eos, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    save_file(_random_weights(config, seed), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(shape, std=DEFAULT_WEIGHT_STD):
        return torch.randn(shape, generator=generator) * std

    def norm_weight(size):
        return 1.0 + normal((size,), NORM_WEIGHT_JITTER)

    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    vocab = config["vocab_size"]
    weights = {"model.word_embeddings.weight": normal((vocab, hidden), DEFAULT_EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = norm_weight(hidden)
        weights[f"{p}.attention.query_key_value.weight"] = normal(
            ((heads + 2 * kv_heads) * head_dim, hidden))
        weights[f"{p}.attention.query_layernorm.weight"] = norm_weight(head_dim)
        weights[f"{p}.attention.key_layernorm.weight"] = norm_weight(head_dim)
        weights[f"{p}.attention.dense.weight"] = normal((hidden, heads * head_dim))
        if config["use_bias"]:
            weights[f"{p}.attention.dense.bias"] = normal((hidden,))
        weights[f"{p}.post_attention_layernorm.weight"] = norm_weight(hidden)
        if i < config["first_k_dense_replace"]:
            _swiglu(weights, f"{p}.mlp", hidden, config["intermediate_size"], normal)
            continue
        experts, inter = config["num_experts"], config["moe_intermediate_size"]
        weights[f"{p}.mlp.gate.weight"] = normal((experts, hidden))
        weights[f"{p}.mlp.gate.expert_bias"] = normal((experts,), 0.5)
        for e in range(experts):
            _swiglu(weights, f"{p}.mlp.experts.{e}", hidden, inter, normal)
        _swiglu(weights, f"{p}.mlp.shared_experts", hidden,
                inter * config["num_shared_experts"], normal)
    weights["model.norm.weight"] = norm_weight(hidden)
    weights["lm_head.weight"] = normal((vocab, hidden), DEFAULT_LM_HEAD_STD)
    return weights


def _swiglu(weights: dict, prefix: str, hidden: int, inter: int, normal) -> None:
    weights[f"{prefix}.gate_proj.weight"] = normal((inter, hidden))
    weights[f"{prefix}.up_proj.weight"] = normal((inter, hidden))
    weights[f"{prefix}.down_proj.weight"] = normal((hidden, inter))
