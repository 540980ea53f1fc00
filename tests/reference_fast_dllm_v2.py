"""Plain-PyTorch reference of Fast-dLLM v2: the published forward and ``generate`` loop.

Written from the authors' code, independently of the package (torch, and Dream's reference
``reference_dream`` for the Qwen2 weights, norms, MLP and head the two share): the model
repository's ``modeling.py`` (``Fast_dLLM_QwenForCausalLM``, as published
with ``Efficient-Large-Model/Fast_dLLM_v2_7B``; NVlabs/Fast-dLLM ``v2/``). Float32, one
sequence.

Forward (inference path): Qwen2's layers -- ``x = embed_tokens[ids]``; per layer ``x +=
o_proj(attn(input_layernorm(x)))``, ``x += down(silu(gate(h)) * up(h))`` with ``h =
post_attention_layernorm(x)``; RMSNorm in float32 times the weight; q/k/v with biases,
``o_proj`` without; rotate-half RoPE (``rope_theta``, no scaling) at the rows' absolute
positions; grouped-query attention -- under ``eval_block_diff_mask``: a query at position
q sees a key at k iff ``k // block_size <= q // block_size``, over the cached keys of the
committed blocks (``past_key_values``) and the forward's own rows. ``update`` appends the
rows' keys/values to the cache (the published ``update_past_key_values=True``).
``lm_head`` (the embedding where ``tie_word_embeddings``). Rows' logits are unshifted.

Decoding (``reference_generate``: ``generate``): the prompt's whole blocks are encoded
into the cache; where the prompt ends on a block boundary the last row's argmax is the
next block's first token. Then per block of ``block_size``: the block (the prompt's tail
or that first token, then masks); while it has masks, for each sub-block of
``small_block_size`` left to right, while the sub-block has masks: one forward, the logits
shifted (``cat([logits[:1], logits[:-1]])`` over the forward's rows: a position reads the
row before it), at the sub-block's masked positions a token and its confidence
(``sample_with_top_p``); every one above ``threshold`` (strictly) and the most confident
(the first on ties) are committed. The forward, without ``use_block_cache`` (the
published default): the whole block against the cache, keeping nothing. With
``use_block_cache``: the whole block, keeping its keys/values as the block cache, when
there is no block cache yet or the sub-block's first position is masked; otherwise only
the sub-block's rows, whose keys/values replace theirs in the block cache, attending to
the committed cache and the whole block cache (no mask), the rest of it stale. A block
with no mask left is encoded once more with its final tokens, into the cache, and that
forward's last row's argmax is the next block's first token (the commit fused with one
autoregressive step; the argmax at any temperature). Before each forward: if the
generated part of the current block holds ``stop_token`` with no mask before it,
decoding stops; the output is cut after the first ``stop_token``. ``max_new_tokens //
block_size`` blocks are decoded.

``sample_with_top_p``: at temperature 0 the softmax's maximum and its token; above it,
the softmax of ``logits / temperature``, every token after the first whose higher-ranked
tokens' probabilities sum above ``top_p`` dropped (sorted descending), renormalised, a
token drawn per row (``torch.multinomial``) and its probability there as its confidence.

Choices the published code does not make:

- the mask token is never proposed: its logit is -inf before the softmax and the argmax
  (the published ones keep it), as the engine does;
- a prompt of exactly one block is encoded into the cache like any prompt ending on a block
  boundary (``>=``; the published ``input_ids.shape[1] > block_size`` leaves it out, so
  the first block would be decoded with no prompt in its context);
- the draws use ``generator`` (the published ones use the global generator, and its
  batched loop draws every sequence's tokens from the first sequence's distributions);
  they are made for the same positions (the sub-block's), so only the random stream
  differs;
- ``rows``, where given, collects the row count of every forward (the published code
  counts nothing).
"""

from __future__ import annotations

import math

import torch

from reference_dream import ReferenceDream, rms_norm

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [Hkv, L, D] keys, values


class ReferenceFastDLLMv2(ReferenceDream):
    """The published forward from a checkpoint directory (config.json + model.safetensors):
    Dream's Qwen2 weights and layers (``ReferenceDream``) under the block-causal mask, over
    a cache of the committed blocks' keys/values."""

    def _block_causal_attention(self, x: torch.Tensor, prefix: str, past: tuple | None,
                                positions: torch.Tensor, block_size: int
                                ) -> tuple[torch.Tensor, tuple]:
        length = x.shape[0]
        q = self._linear(x, prefix + "q_proj").view(length, self.num_heads, self.head_dim)
        k = self._linear(x, prefix + "k_proj").view(length, self.num_kv_heads, self.head_dim)
        v = self._linear(x, prefix + "v_proj").view(length, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        q, k = self._rope(q, positions), self._rope(k, positions)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
        keys = torch.arange(k.shape[1])
        visible = keys[None, :] // block_size <= positions[:, None] // block_size  # [L, K]
        group = self.num_heads // self.num_kv_heads
        scores = (q @ k.repeat_interleave(group, dim=0).transpose(1, 2)) / math.sqrt(
            self.head_dim)  # [H, L, K]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = scores.softmax(dim=-1) @ v.repeat_interleave(group, dim=0)  # [H, L, D]
        return self._linear(out.transpose(0, 1).reshape(length, -1), prefix + "o_proj"), (k, v)

    @torch.no_grad()
    def forward(self, token_ids: list[int], past: KeyValues | None, block_size: int,
                update: bool) -> tuple[torch.Tensor, KeyValues | None]:
        """Rows' logits [L, vocab] of ``token_ids`` placed after the cached keys, and the
        cache with their keys/values appended where ``update`` (else ``past``)."""
        w, cfg = self.weights, self.config
        start = 0 if past is None else past[0][0].shape[1]
        positions = torch.arange(start, start + len(token_ids))
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]  # [L, hidden]
        cache = []
        for i in range(cfg["num_hidden_layers"]):
            layer = f"model.layers.{i}."
            normed = rms_norm(x, w[layer + "input_layernorm.weight"], self.eps)
            out, kv = self._block_causal_attention(
                normed, layer + "self_attn.", None if past is None else past[i], positions,
                block_size)
            x = x + out
            cache.append(kv)
            x = self._feed_forward(x, layer)
        return self._logits(x), (cache if update else past)

    __call__ = forward

    @torch.no_grad()
    def forward_in_block(self, token_ids: list[int], past: KeyValues | None,
                         block: KeyValues, offset: int) -> torch.Tensor:
        """Rows' logits [L, vocab] of ``token_ids`` at block positions ``offset`` on (the
        block after the cached keys): their keys/values replace the block cache's
        (``block``, in place) at those positions, and they attend to the cached keys and
        the whole block cache."""
        w, cfg = self.weights, self.config
        start = 0 if past is None else past[0][0].shape[1]
        positions = torch.arange(start + offset, start + offset + len(token_ids))
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]  # [L, hidden]
        for i in range(cfg["num_hidden_layers"]):
            layer = f"model.layers.{i}."
            normed = rms_norm(x, w[layer + "input_layernorm.weight"], self.eps)
            x = x + self._attention_in_block(normed, layer + "self_attn.",
                                             None if past is None else past[i], block[i],
                                             positions, offset)
            x = self._feed_forward(x, layer)
        return self._logits(x)

    def _attention_in_block(self, x: torch.Tensor, prefix: str, past: tuple | None,
                            block: tuple, positions: torch.Tensor, offset: int
                            ) -> torch.Tensor:
        length = x.shape[0]
        q = self._linear(x, prefix + "q_proj").view(length, self.num_heads, self.head_dim)
        k = self._linear(x, prefix + "k_proj").view(length, self.num_kv_heads, self.head_dim)
        v = self._linear(x, prefix + "v_proj").view(length, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        q, k = self._rope(q, positions), self._rope(k, positions)
        block[0][:, offset:offset + length] = k
        block[1][:, offset:offset + length] = v
        keys, values = block
        if past is not None:
            keys, values = torch.cat((past[0], keys), dim=1), torch.cat((past[1], values), dim=1)
        group = self.num_heads // self.num_kv_heads
        scores = (q @ keys.repeat_interleave(group, dim=0).transpose(1, 2)) / math.sqrt(
            self.head_dim)  # [H, L, K], every key visible
        out = scores.softmax(dim=-1) @ values.repeat_interleave(group, dim=0)  # [H, L, D]
        return self._linear(out.transpose(0, 1).reshape(length, -1), prefix + "o_proj")


def _stopped(x: list[int], generated_from: int, stop_token: int | None, mask_id: int) -> bool:
    """The published check: the generated part holds the stop token, no mask before it."""
    tail = x[generated_from:]
    if stop_token is None or stop_token not in tail:
        return False
    return mask_id not in tail[:tail.index(stop_token)]


def mask_banned(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    logits = logits.clone()
    logits[..., mask_id] = float("-inf")
    return logits


def sample_with_top_p(logits: torch.Tensor, mask_id: int, temperature: float, top_p: float,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [L, vocab]. Tokens [L] and their confidences [L]."""
    logits = mask_banned(logits, mask_id)
    if temperature <= 0:
        confidence, tokens = logits.softmax(dim=-1).max(dim=-1)
        return tokens, confidence
    probs = (logits / temperature).softmax(dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    drop = ranked.cumsum(dim=-1) > top_p
    drop[:, 1:] = drop[:, :-1].clone()  # a token goes once those above it pass top_p
    drop[:, 0] = False
    probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1)


@torch.no_grad()
def reference_generate(model: ReferenceFastDLLMv2, prompt_ids: list[int], *, mask_id: int,
                       max_new_tokens: int, block_size: int = 32, small_block_size: int = 8,
                       threshold: float = 0.9, stop_token: int | None = None,
                       use_block_cache: bool = False, temperature: float = 0.0,
                       top_p: float = 0.95, generator: torch.Generator | None = None,
                       rows: list[int] | None = None) -> list[int]:
    """``generate`` for one prompt; returns the generated ids, cut after the first
    ``stop_token``. ``rows``: where given, each forward's row count is appended."""

    def forward(token_ids, past, update):
        if rows is not None:
            rows.append(len(token_ids))
        return model(token_ids, past, block_size, update=update)

    def first_token(logits: torch.Tensor) -> int:
        return int(mask_banned(logits[-1], mask_id).argmax())

    ids, num_prompt, past = list(prompt_ids), len(prompt_ids), None
    if num_prompt >= block_size:
        whole = num_prompt // block_size * block_size
        logits, past = forward(ids[:whole], None, update=True)
        if num_prompt % block_size == 0:
            ids.append(first_token(logits))
    for _ in range(max_new_tokens // block_size):
        if stop_token is not None and stop_token in ids[num_prompt:]:
            break
        generated_from = len(ids)
        x = ids + [mask_id] * (block_size - len(ids) % block_size)
        block_cache = None  # the block's keys/values under use_block_cache
        while not _stopped(x, generated_from, stop_token, mask_id):
            if mask_id not in x[-block_size:]:
                logits, past = forward(x[-block_size:], past, update=True)
                x.append(first_token(logits))
                break
            for start in range(0, block_size, small_block_size):
                end = start + small_block_size
                while True:
                    block = x[-block_size:]
                    masked = torch.tensor([t == mask_id for t in block[start:end]])
                    if not bool(masked.any()) or _stopped(x, generated_from, stop_token,
                                                          mask_id):
                        break
                    if use_block_cache and block_cache is not None and block[start] != mask_id:
                        if rows is not None:
                            rows.append(end - start)
                        logits = model.forward_in_block(block[start:end], past, block_cache,
                                                        start)
                        logits = torch.cat([logits[:1], logits[:-1]])  # row j - 1
                    else:
                        logits, kept = forward(block, past, update=use_block_cache)
                        if use_block_cache:
                            begin = 0 if past is None else past[0][0].shape[1]
                            block_cache = [(k[:, begin:], v[:, begin:]) for k, v in kept]
                        logits = torch.cat([logits[:1], logits[:-1]])[start:end]  # row j - 1
                    tokens, confidence = sample_with_top_p(logits, mask_id, temperature,
                                                           top_p, generator)
                    confidence = torch.where(masked, confidence, float("-inf"))
                    commit = confidence > threshold
                    commit[int(confidence.argmax())] = True
                    commit &= masked
                    for j in torch.nonzero(commit).flatten().tolist():
                        x[len(x) - block_size + start + j] = int(tokens[j])
        ids = x
    out = ids[num_prompt:]
    if stop_token is not None and stop_token in out:
        out = out[:out.index(stop_token) + 1]
    return out
