"""Greedy block-diffusion decoding of an SDAR checkpoint with transformers, without vLLM:
the training tools' evaluation and a quick look at a checkpoint (``tools/sample_sdar.py``).

No KV cache: every denoising step re-runs the whole sequence up to the end of
the current block under the block-causal mask (block grid aligned to absolute
position 0, the prompt tail shares its block with the first masks). Unmasking
is low-confidence-dynamic: commit every masked position whose greedy
probability exceeds the threshold, and at least the single most confident one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from vllm_diffusion_lab.quality.corpus import Example, score


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """[length, length] bool; query i sees key j iff j's block is not after i's block."""
    blocks = torch.arange(length) // block_size
    return blocks[None, :] <= blocks[:, None]


def qwen3_config_from_sdar(sdar: dict) -> Qwen3Config:
    """The Qwen3 config that instantiates the same network as an SDAR ``config.json``."""
    config = Qwen3Config(
        vocab_size=sdar["vocab_size"],
        hidden_size=sdar["hidden_size"],
        intermediate_size=sdar["intermediate_size"],
        num_hidden_layers=sdar["num_hidden_layers"],
        num_attention_heads=sdar["num_attention_heads"],
        num_key_value_heads=sdar["num_key_value_heads"],
        head_dim=sdar["head_dim"],
        max_position_embeddings=sdar["max_position_embeddings"],
        rms_norm_eps=sdar["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": sdar["rope_theta"]},
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=sdar.get("bos_token_id"),
        eos_token_id=sdar.get("eos_token_id"),
        pad_token_id=sdar.get("pad_token_id"),
    )
    config._attn_implementation = "sdpa"
    return config


def load_sdar(path: Path) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerBase, dict, list[int]]:
    """Load model (eval mode), tokenizer, raw SDAR config and the stop token ids."""
    sdar = json.loads((path / "config.json").read_text())
    model = Qwen3ForCausalLM(qwen3_config_from_sdar(sdar))
    model.load_state_dict(load_file(path / "model.safetensors"))
    model.eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    stop_ids = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    return model, tokenizer, sdar, stop_ids if isinstance(stop_ids, list) else [stop_ids]


@torch.no_grad()
def generate(
    model: Qwen3ForCausalLM,
    prompt_ids: list[int],
    *,
    mask_id: int,
    stop_ids: list[int],
    block_size: int,
    max_new_tokens: int = 96,
    threshold: float = 0.9,
) -> list[int]:
    """Greedy block-diffusion decoding; returns generated ids up to (excluding) the first stop id."""
    prompt_len = len(prompt_ids)
    num_blocks = -(-(prompt_len + max_new_tokens) // block_size)
    tokens = torch.full((num_blocks * block_size,), mask_id, dtype=torch.long)  # [num_blocks * BS]
    tokens[:prompt_len] = torch.tensor(prompt_ids)
    stops = torch.tensor(stop_ids)
    end = prompt_len
    for block in range(prompt_len // block_size, num_blocks):
        start, end = block * block_size, (block + 1) * block_size
        attention_mask = block_causal_mask(end, block_size)[None, None]  # [1, 1, end, end]
        position_ids = torch.arange(end)[None]
        while True:
            masked = tokens[start:end] == mask_id  # [BS]
            if not masked.any():
                break
            logits = model(input_ids=tokens[None, :end], attention_mask=attention_mask,
                           position_ids=position_ids).logits[0, start:end].float()  # [BS, V]
            logits[:, mask_id] = float("-inf")
            confidence, predicted = logits.softmax(-1).max(-1)  # [BS], [BS]
            confidence = confidence.masked_fill(~masked, -1.0)
            commit = masked & (confidence > threshold)
            if not commit.any():
                commit[confidence.argmax()] = True
            tokens[start:end] = torch.where(commit, predicted, tokens[start:end])
        if torch.isin(tokens[prompt_len:end], stops).any():
            break
    generated = tokens[prompt_len:end].tolist()[:max_new_tokens]
    for index, token in enumerate(generated):
        if token in stop_ids:
            return generated[:index]
    return generated


def respond(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt: str, *,
            mask_id: int, stop_ids: list[int], block_size: int, threshold: float = 0.9) -> str:
    """Chat-format ``prompt``, decode, and return the assistant text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    output = generate(model, prompt_ids, mask_id=mask_id, stop_ids=stop_ids,
                      block_size=block_size, threshold=threshold)
    return tokenizer.decode(output, skip_special_tokens=True)


def evaluate(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, examples: list[Example], *,
             mask_id: int, stop_ids: list[int], block_size: int, threshold: float = 0.9,
             show: int = 0) -> dict[str, float]:
    """Per-family accuracy of greedy decoding on ``examples``.

    Prints the first sample of each of the first ``show`` families.
    """
    correct: dict[str, list[bool]] = defaultdict(list)
    for index, example in enumerate(examples):
        text = respond(model, tokenizer, example.prompt, mask_id=mask_id, stop_ids=stop_ids,
                       block_size=block_size, threshold=threshold)
        ok = score(example.family, example.answer, text)
        correct[example.family].append(ok)
        if len(correct[example.family]) == 1 and len(correct) <= show:
            print(f"[{example.family}] {example.prompt}\n  expected: {example.answer!r}\n"
                  f"  got:      {text!r}  {'OK' if ok else 'WRONG'}")
    return {family: sum(flags) / len(flags) for family, flags in correct.items()}
