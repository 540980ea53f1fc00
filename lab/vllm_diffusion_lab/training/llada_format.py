"""A small full-attention masked-diffusion model in LLaDA's published checkpoint format, in
plain PyTorch (``tools/train_llada.py`` trains it).

- ``LLaDAModelLM``: the ``block_type: llama`` network of LLaDA's ``modeling_llada.py`` with
  the published parameter names (``model.transformer.wte``, ``blocks.{i}.{attn_norm, q_proj,
  k_proj, v_proj, attn_out, ff_norm, ff_proj, up_proj, ff_out}``, ``ln_f``, ``ff_out``):
  pre-norm RMSNorm blocks, RoPE (rotate-half, float32), SwiGLU (``silu(ff_proj(x)) *
  up_proj(x)`` into ``ff_out``), grouped-query attention via ``n_kv_heads``, no biases, no
  q/k norms, untied output layer, and every position attending to every other (no causal mask).
- ``llada_config`` / ``save_checkpoint``: ``config.json`` with the published config's keys,
  ``generation_config.json``, the tokenizer files and chat template of the source checkpoint.
- ``sdar_to_llada``: an SDAR (Qwen3-architecture) state dict renamed into this format.
- ``sft_loss``: LLaDA's SFT objective; ``generate``: LLaDA's ``generate.py`` loop, greedy.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from vllm_diffusion_lab.quality.corpus import Example, score

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Block(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        d, heads, kv_heads = config["d_model"], config["n_heads"], config["n_kv_heads"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        hidden, eps = config["mlp_hidden_size"], config["rms_norm_eps"]
        self.attn_norm, self.ff_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, hidden, bias=False)  # the SwiGLU gate
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.ff_out = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, d = x.shape
        normed = self.attn_norm(x)
        q = self.q_proj(normed).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(normed).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(normed).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             enable_gqa=self.kv_heads != self.heads)
        x = x + self.attn_out(att.transpose(1, 2).reshape(batch, length, d))
        normed = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(normed)) * self.up_proj(normed))


class LLaDAModelLM(nn.Module):
    """``model(input_ids [b, L], attention_mask=None) -> logits [b, L, vocab]``; the optional
    ``attention_mask`` is [b, L] (1 = real token, as LLaDA's padding mask) or a bool
    [b or 1, 1, L, L] (True = may attend; tests compare against causal models with it)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        vocab, d = config["embedding_size"] or config["vocab_size"], config["d_model"]
        self.model = nn.Module()
        self.model.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d),
            blocks=nn.ModuleList(Block(config) for _ in range(config["n_layers"])),
            ln_f=RMSNorm(d, config["rms_norm_eps"]),
            ff_out=nn.Linear(d, vocab, bias=False)))
        for name, parameter in self.named_parameters():
            if parameter.ndim == 2:
                nn.init.normal_(parameter, std=config.get("init_std", 0.02))

    def hidden_states(self, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final (``ln_f``-normalised) hidden states [b, L, d_model]."""
        transformer, length = self.model.transformer, input_ids.shape[1]
        head_dim = self.config["d_model"] // self.config["n_heads"]
        inv_freq = 1.0 / self.config["rope_theta"] ** (
            torch.arange(0, head_dim, 2, device=input_ids.device, dtype=torch.float) / head_dim)
        angles = torch.arange(length, device=input_ids.device, dtype=torch.float)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)  # [L, head_dim]
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask.bool()[:, None, None, :]
        x = transformer.wte(input_ids)
        for block in transformer.blocks:
            x = block(x, angles.cos(), angles.sin(), attention_mask)
        return transformer.ln_f(x)

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.transformer.ff_out(self.hidden_states(input_ids, attention_mask))


# ------------------------------------------------------------------ format
def llada_config(*, d_model: int, n_heads: int, n_kv_heads: int, n_layers: int,
                 mlp_hidden_size: int, vocab_size: int, max_sequence_length: int,
                 rope_theta: float, rms_norm_eps: float, mask_token_id: int, eos_token_id: int,
                 pad_token_id: int, torch_dtype: str = "bfloat16") -> dict:
    """``config.json`` with the keys (and fixed values) of LLaDA-8B-Instruct's; the shape,
    the special token ids and ``torch_dtype`` (the saved weights' dtype) are ours."""
    return {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": d_model, "embedding_dropout": 0.0, "embedding_size": vocab_size,
        "eos_token_id": eos_token_id, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": mask_token_id,
        "max_sequence_length": max_sequence_length, "mlp_hidden_size": mlp_hidden_size,
        "mlp_ratio": max(1, mlp_hidden_size // d_model), "model_type": "llada",
        "multi_query_attention": None, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
        "n_layers": n_layers, "pad_token_id": pad_token_id, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": rms_norm_eps, "rope": True,
        "rope_full_precision": True, "rope_theta": rope_theta, "scale_logits": False,
        "torch_dtype": torch_dtype, "use_cache": False, "vocab_size": vocab_size,
        "weight_tying": False,
    }


def config_from_sdar(sdar: dict, n_layers: int) -> dict:
    """The LLaDA config of an SDAR config's shape with ``n_layers`` layers. ``eos_token_id``
    is ``<|endoftext|>`` (the SDAR pad id), the token LLaDA's SFT pads responses with, as
    LLaDA's own 126081; the end of turn ``<|im_end|>`` plays ``<|eot_id|>``'s part."""
    if sdar["num_attention_heads"] * sdar["head_dim"] != sdar["hidden_size"]:
        raise ValueError("LLaDA needs head_dim == d_model / n_heads")
    return llada_config(
        d_model=sdar["hidden_size"], n_heads=sdar["num_attention_heads"],
        n_kv_heads=sdar["num_key_value_heads"], n_layers=n_layers,
        mlp_hidden_size=sdar["intermediate_size"], vocab_size=sdar["vocab_size"],
        max_sequence_length=sdar["max_position_embeddings"], rope_theta=sdar["rope_theta"],
        rms_norm_eps=sdar["rms_norm_eps"], mask_token_id=sdar["mask_token_id"],
        eos_token_id=sdar["pad_token_id"], pad_token_id=sdar["pad_token_id"])


def save_checkpoint(weights: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path,
                    out: Path, end_of_turn_id: int) -> None:
    """Write config, generation config, the tokenizer files of ``tokenizer_dir``, then the
    weights in ``config["torch_dtype"]`` (atomically, last: readers key on model.safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and tokenizer_dir.resolve() != out.resolve():
            shutil.copy2(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["pad_token_id"], "pad_token_id": config["pad_token_id"],
                  "eos_token_id": [end_of_turn_id, config["eos_token_id"]], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    dtype = getattr(torch, config["torch_dtype"])
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in weights.items()}
    save_file(state, out / "model.safetensors.partial", metadata={"format": "pt"})
    os.replace(out / "model.safetensors.partial", out / "model.safetensors")


SDAR_NAMES = {  # SDAR (Qwen3) layer weight -> LLaDA block weight
    "input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out",
    "post_attention_layernorm": "ff_norm", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}
SDAR_DROPPED = ("self_attn.q_norm", "self_attn.k_norm")  # LLaDA has no q/k norms


def sdar_to_llada(sdar: dict[str, torch.Tensor], keep_layers: list[int]) -> dict[str, torch.Tensor]:
    """The LLaDA state dict of an SDAR one, SDAR layer ``keep_layers[j]`` becoming block j.
    Embeddings, q/k/v/o, the SwiGLU gate/up/down, the norms and the LM head carry over
    unchanged (same RoPE convention, same shapes); the q/k RMSNorm gains are dropped."""
    prefix = "model.transformer."
    out = {prefix + "wte.weight": sdar["model.embed_tokens.weight"],
           prefix + "ln_f.weight": sdar["model.norm.weight"],
           prefix + "ff_out.weight": sdar["lm_head.weight"]}
    for block, layer in enumerate(keep_layers):
        for old, new in SDAR_NAMES.items():
            out[f"{prefix}blocks.{block}.{new}.weight"] = sdar[f"model.layers.{layer}.{old}.weight"]
    return out


# --------------------------------------------------------------- objective
def sft_batch(items: list[tuple[list[int], list[int]]], canvas: int, eos_id: int):
    """LLaDA SFT rows: prompt, response (ending in the end-of-turn token), then EOS up to the
    response region's ``canvas`` length, and more EOS so that every row of the batch has
    the same length (LLaDA pads each mini-batch with EOS). Returns ids [b, L] and prompt
    lengths [b]; everything after the prompt is the response."""
    length = max(len(prompt) + max(len(response), canvas) for prompt, response in items)
    ids = torch.full((len(items), length), eos_id, dtype=torch.long)
    for row, (prompt, response) in enumerate(items):
        ids[row, :len(prompt) + len(response)] = torch.tensor(prompt + response)
    return ids, torch.tensor([len(prompt) for prompt, _ in items])


def sft_loss(model: LLaDAModelLM, ids: torch.Tensor, prompt_lengths: torch.Tensor, *,
             mask_id: int, eps: float, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """LLaDA's SFT loss (the repository's GUIDELINES.md): per sequence a ratio
    p = eps + (1 - eps) t, t ~ U(0, 1); every response position is masked with probability
    p (the prompt never); loss = sum over masked positions of CE / p / (the sequence's
    response length, EOS padding included), divided by the batch size. Also returns the
    masks and the plain mean CE over masked positions (for logs)."""
    batch, length = ids.shape
    ratio = eps + (1 - eps) * torch.rand(batch, generator=generator)  # [b]
    response = torch.arange(length)[None, :] >= prompt_lengths[:, None]  # [b, L]
    masked = response & (torch.rand(batch, length, generator=generator) < ratio[:, None])
    weight = (1.0 / (ratio[:, None] * response.sum(1, keepdim=True))).expand(batch, length)[masked]
    device = model.model.transformer.wte.weight.device
    noisy = ids.masked_fill(masked, mask_id).to(device)
    hidden = model.hidden_states(noisy)[masked.to(device)]  # [n masked, d]
    ce = F.cross_entropy(model.model.transformer.ff_out(hidden).float(), ids[masked].to(device),
                         reduction="none")
    loss = (ce * weight.to(device)).sum() / batch
    return loss, {"masked": masked, "ce": ce.detach(), "weight": weight}


# ---------------------------------------------------------------- decoding
@torch.no_grad()
def generate(model: LLaDAModelLM, prompt_ids: list[int], *, mask_id: int, gen_length: int = 128,
             block_length: int = 32, steps: int | None = None, on_step=None) -> list[int]:
    """LLaDA's ``generate.py`` at temperature 0, ``low_confidence``, no CFG, one prompt: a
    canvas of ``gen_length`` masks after the prompt, decoded in blocks of ``block_length``
    with ``steps`` (default ``gen_length``: one token per step) split evenly over the blocks;
    in a block, step i commits the ``n // s`` (+1 for the first ``n % s`` steps) masked
    positions, up to the block's end, with the highest softmax probability of their argmax
    token. Returns the whole canvas. ``on_step(masked, chosen, block_start, block_end)``, if
    given, is called after each step's forward and commit (masked: [L] bool before it,
    chosen: the committed positions; absolute positions), e.g. to record the step."""
    steps = steps or gen_length
    if gen_length % block_length or steps % (gen_length // block_length):
        raise ValueError("gen_length must be a multiple of block_length, steps of the blocks")
    device = model.model.transformer.wte.weight.device
    start = len(prompt_ids)
    x = torch.full((1, start + gen_length), mask_id, dtype=torch.long, device=device)
    x[0, :start] = torch.tensor(prompt_ids)
    per_block = steps // (gen_length // block_length)
    for block_end in range(start + block_length, start + gen_length + 1, block_length):
        count = int((x[0, block_end - block_length:block_end] == mask_id).sum())
        quotas = [count // per_block + (i < count % per_block) for i in range(per_block)]
        for quota in quotas:
            if quota == 0:  # LLaDA runs the forward and commits nothing
                continue
            masked = x[0] == mask_id
            logits = model(x)[0]  # [L, V]
            predicted = logits.argmax(-1)
            confidence = logits.softmax(-1).gather(-1, predicted[:, None])[:, 0]
            confidence[block_end:] = float("-inf")
            confidence = torch.where(masked, confidence, float("-inf"))
            chosen = torch.topk(confidence, k=quota).indices
            x[0, chosen] = predicted[chosen]
            if on_step is not None:
                on_step(masked, chosen, block_end - block_length, block_end)
    return x[0, start:].tolist()


def evaluate(model: LLaDAModelLM, tokenizer, examples: list[Example], *, mask_id: int,
             stop_ids: list[int], gen_length: int, block_length: int,
             show: int = 0) -> dict[str, float]:
    """Per-family accuracy of ``generate`` (chat template; the text up to the first stop id)."""
    correct: dict[str, list[bool]] = defaultdict(list)
    for example in examples:
        text = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                             add_generation_prompt=True, tokenize=False)
        canvas = generate(model, tokenizer(text, add_special_tokens=False)["input_ids"],
                          mask_id=mask_id, gen_length=gen_length, block_length=block_length)
        stops = [i for i, token in enumerate(canvas) if token in stop_ids]
        answer = tokenizer.decode(canvas[:stops[0] if stops else None], skip_special_tokens=True)
        ok = score(example.family, example.answer, answer)
        correct[example.family].append(ok)
        if len(correct[example.family]) == 1 and len(correct) <= show:
            print(f"[{example.family}] {example.prompt}\n  expected: {example.answer!r}\n"
                  f"  got:      {answer!r}  {'OK' if ok else 'WRONG'}", flush=True)
    return {family: sum(flags) / len(flags) for family, flags in correct.items()}
