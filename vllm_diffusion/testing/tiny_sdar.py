"""Tiny, seeded SDAR checkpoints in Hugging Face layout, for tests and examples.

`build_tiny_sdar(path)` writes a directory that loads like a real SDAR (or SDAR-MoE)
checkpoint: `config.json`, `generation_config.json`, `model.safetensors` (float32, Qwen3 /
Qwen3-MoE weight names) and a byte-level BPE tokenizer with ChatML special tokens and a
`<|MASK|>` token. Everything is built in code from a seed; nothing is downloaded.

The weights are random but deliberately not small: the logits are peaky, so greedy
decisions and confidence rankings of two float32 implementations are not decided by
rounding noise, while the confidences still span a wide range (see `DEFAULT_*_STD`).
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Std of every projection weight (attention, MLP, router). About 1/sqrt(hidden_size) for the
# default width, so each layer moves the residual stream by O(1) and outputs depend on context.
DEFAULT_WEIGHT_STD = 0.125
# Std of the token embeddings (the residual stream starts at RMS ~1).
DEFAULT_EMBED_STD = 1.0
# Std of the lm_head rows: logits have std ~ lm_head_std * sqrt(hidden_size) (~10 by default).
# With the defaults the greedy confidence at masked block positions spans roughly 0.35 (10th
# percentile) to 0.99 (90th); about a quarter is above 0.9 and a quarter below 0.5.
DEFAULT_LM_HEAD_STD = 1.2
# The EOS row of lm_head is scaled by this factor so that greedy decoding emits EOS now and
# then (tests need stops inside blocks) without emitting it all the time.
DEFAULT_EOS_ROW_SCALE = 3.5
# Relative random perturbation of the RMSNorm weights around 1.0, so that a loader that
# swaps or drops a norm weight changes the outputs.
NORM_WEIGHT_JITTER = 0.1

DEFAULT_VOCAB_SIZE = 512

_TRAINING_TEXT = """\
The small town sat at the edge of a wide green valley, where the river turned slowly to the
east. Every morning the baker opened her shop at six o'clock, and the smell of fresh bread
drifted down the main street. Children walked to school in pairs, talking about games,
books, and the weather. Their teacher, Mr. Hill, liked to begin each lesson with a question:
"What did you notice on the way here today?" Some days the answer was a red bird on a fence;
other days it was a truck full of apples, or a cloud shaped like a boat.

In the afternoon the market filled with people. Farmers brought potatoes, onions, carrots,
and eggs. A man sold honey in glass jars for 4 dollars each, or 3 jars for 10 dollars. An
old woman repaired shoes under a blue umbrella, and she always had a story about the years
when the bridge was still made of wood. Music came from the square, where two students
played the violin and the guitar for anyone who would stop and listen.

When the sun went down, the lights in the houses came on one by one. Families cooked dinner,
washed the dishes, and read the news. The library stayed open until nine, and the quiet room
upstairs was full of people writing letters, solving puzzles, or learning a new language.
Numbers, names, and dates filled the notebooks: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89.

Questions are useful because they help us think. Why does the river move faster after rain?
How many stars can you count on a clear night? Which road is the shortest way home? A good
answer is short, clear, and honest. A helpful assistant listens first, then explains the
idea step by step, and finally checks that the answer makes sense.

The user asked the assistant to write a short poem about the sea. The assistant wrote:
waves return, the gulls call, the light is gold on the water, and the day begins again.
Thank you, said the user. You are welcome, said the assistant. Have a nice day!
"""


def train_bpe(special_tokens: tuple[str, ...], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A deterministic byte-level BPE trained on a small built-in English text; the special
    tokens take ids 0.. in the given order. Byte-level pre-tokenization means any string
    (ASCII or not) encodes without unknown tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The tiny SDAR tokenizer (``train_bpe`` with `SPECIAL_TOKENS`, ids 0..3).

    Returns:
        A `transformers.PreTrainedTokenizerFast` with eos/pad = `<|endoftext|>`,
        mask = `<|MASK|>` and a ChatML chat template.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(SPECIAL_TOKENS, vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def _model_config(
    *,
    moe: bool,
    vocab_size: int,
    token_ids: dict[str, int],
    block_size: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_position_embeddings: int,
) -> dict:
    config = {
        "architectures": ["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        "model_type": "sdar_moe" if moe else "sdar",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": token_ids[EOS_TOKEN],
        "eos_token_id": token_ids[EOS_TOKEN],
        "pad_token_id": token_ids[EOS_TOKEN],
        "block_size": block_size,
        "mask_token_id": token_ids[MASK_TOKEN],
        "torch_dtype": "float32",
    }
    if moe:
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


def _random_weights(
    config: dict,
    *,
    seed: int,
    weight_std: float,
    embed_std: float,
    lm_head_std: float,
    eos_row_scale: float,
) -> dict[str, torch.Tensor]:
    """Seeded float32 weights named as in Qwen3 / Qwen3-MoE HF checkpoints."""
    generator = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    def norm_weight(size: int) -> torch.Tensor:
        return 1.0 + normal((size,), NORM_WEIGHT_JITTER)

    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    vocab = config["vocab_size"]

    weights = {"model.embed_tokens.weight": normal((vocab, hidden), embed_std)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.input_layernorm.weight"] = norm_weight(hidden)
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal((q_size, hidden), weight_std)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal((kv_size, hidden), weight_std)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal((kv_size, hidden), weight_std)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal((hidden, q_size), weight_std)
        weights[f"{prefix}.self_attn.q_norm.weight"] = norm_weight(head_dim)
        weights[f"{prefix}.self_attn.k_norm.weight"] = norm_weight(head_dim)
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm_weight(hidden)
        if "num_experts" in config:
            inter = config["moe_intermediate_size"]
            weights[f"{prefix}.mlp.gate.weight"] = normal((config["num_experts"], hidden), weight_std)
            for e in range(config["num_experts"]):
                expert = f"{prefix}.mlp.experts.{e}"
                weights[f"{expert}.gate_proj.weight"] = normal((inter, hidden), weight_std)
                weights[f"{expert}.up_proj.weight"] = normal((inter, hidden), weight_std)
                weights[f"{expert}.down_proj.weight"] = normal((hidden, inter), weight_std)
        else:
            inter = config["intermediate_size"]
            weights[f"{prefix}.mlp.gate_proj.weight"] = normal((inter, hidden), weight_std)
            weights[f"{prefix}.mlp.up_proj.weight"] = normal((inter, hidden), weight_std)
            weights[f"{prefix}.mlp.down_proj.weight"] = normal((hidden, inter), weight_std)
    weights["model.norm.weight"] = norm_weight(hidden)
    lm_head = normal((vocab, hidden), lm_head_std)  # [vocab, hidden]
    lm_head[config["eos_token_id"]] *= eos_row_scale
    weights["lm_head.weight"] = lm_head
    return weights


def build_tiny_sdar(
    path: str | pathlib.Path,
    *,
    moe: bool = False,
    block_size: int = 4,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    weight_std: float = DEFAULT_WEIGHT_STD,
    embed_std: float = DEFAULT_EMBED_STD,
    lm_head_std: float = DEFAULT_LM_HEAD_STD,
    eos_row_scale: float = DEFAULT_EOS_ROW_SCALE,
    max_position_embeddings: int = 2048,
) -> pathlib.Path:
    """Write a tiny random SDAR (or SDAR-MoE, `moe=True`) checkpoint to `path`.

    The same arguments always produce byte-identical weights and tokenizer files.

    Returns:
        The checkpoint directory as a `pathlib.Path`.
    """
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}

    config = _model_config(
        moe=moe,
        vocab_size=len(tokenizer),
        token_ids=token_ids,
        block_size=block_size,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
    )
    generation_config = {
        "bos_token_id": token_ids[EOS_TOKEN],
        # Qwen3-chat style: stop at the end of a turn or at end of text.
        "eos_token_id": [token_ids[IM_END_TOKEN], token_ids[EOS_TOKEN]],
        "pad_token_id": token_ids[EOS_TOKEN],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")

    weights = _random_weights(
        config,
        seed=seed,
        weight_std=weight_std,
        embed_std=embed_std,
        lm_head_std=lm_head_std,
        eos_row_scale=eos_row_scale,
    )
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
