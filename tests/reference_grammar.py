"""Plain reference of grammar-constrained block decoding (greedy): SDAR's loop
(``reference_sdar``) with an xgrammar matcher, the rule the engine implements.

The rule is the plugin's (no paper defines grammar-constrained block decoding): F is the
block's leftmost masked position; F's logits are masked by the grammar; from F rightwards
each position's candidate is the grammar's forced text (xgrammar's jump-forward string, tokenized by the
model's tokenizer, all but its last token; or its only allowed token; confidence 1) or, if the grammar accepts it,
the position's arg-max proposal; the walk stops at the first position
with neither or once the grammar is complete. The strategy chooses among the walked
positions; only the run contiguous from F is committed, F always. Imports no package code.
"""

from __future__ import annotations

import torch
import xgrammar as xgr
from reference_focus import generate_by_blocks
from reference_sdar import ReferenceSDAR, block_causal_mask, select_positions, transfer_quotas


def allowed_tokens(matcher: xgr.GrammarMatcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


@torch.no_grad()
def reference_grammar_generate(model: ReferenceSDAR, tokenizer, prompt: list[int], *,
                               regex: str, block_size: int, mask_id: int, vocab_size: int,
                               max_tokens: int, stop_token_ids: set[int],
                               strategy: str = "low_confidence_dynamic",
                               threshold: float = 0.9) -> list[int]:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex),
                                 override_stop_tokens=sorted(stop_token_ids))
    quotas = transfer_quotas(block_size, block_size)

    def decode_block(start: int, committed: list[int], block: torch.Tensor) -> torch.Tensor:
        step = 0
        while bool((block == mask_id).any()):
            tokens = torch.cat((torch.tensor(committed, dtype=torch.long), block))
            logits = model.forward(tokens, block_causal_mask(len(tokens), block_size))
            logits = logits[-block_size:].float()
            logits[:, mask_id] = float("-inf")
            first = int(torch.nonzero(block == mask_id).flatten()[0])
            constrained = not matcher.is_terminated()  # complete: nothing more to constrain
            if constrained:
                logits[first] = logits[first].masked_fill(
                    ~allowed_tokens(matcher, vocab_size), float("-inf"))
            probs = logits.softmax(dim=-1)
            confidence, proposal = probs.max(dim=-1)
            candidates, trust = proposal.clone(), confidence.clone()
            walked = (block == mask_id) if not constrained else walk(
                matcher, tokenizer, vocab_size, first, proposal, candidates, trust)
            scored = torch.where(walked, trust, torch.full_like(trust, float("-inf")))
            chosen = select_positions(strategy, scored, walked, quotas[step], threshold,
                                      step == block_size - 1)
            if constrained:
                run = first + 1
                while run < block_size and bool(walked[run]) and bool(chosen[run]):
                    run += 1
                chosen = torch.zeros_like(chosen)
                chosen[first:run] = True
                for token in candidates[first:run].tolist():
                    if matcher.is_terminated():
                        break
                    assert matcher.accept_token(token)
            block = torch.where(chosen, candidates, block)
            step += 1
        return block

    return generate_by_blocks(prompt, block_size, mask_id, max_tokens, stop_token_ids,
                              decode_block)


def walk(matcher: xgr.GrammarMatcher, tokenizer, vocab_size: int, first: int,
         proposal: torch.Tensor, candidates: torch.Tensor, trust: torch.Tensor
         ) -> torch.Tensor:
    """[B] bool the walked positions from ``first``; their candidates and confidences
    written into ``candidates`` and ``trust``; the matcher rolled back."""
    block_size = len(proposal)
    walked = torch.zeros(block_size, dtype=torch.bool)
    accepted, position = 0, first
    while position < block_size and not matcher.is_terminated():
        text = matcher.find_jump_forward_string()
        # all but the last token: it may merge with the text after it
        forced = tokenizer.encode(text, add_special_tokens=False)[:-1] if text else []
        if not forced:
            allowed = allowed_tokens(matcher, vocab_size)
            if int(allowed.sum()) == 1:
                forced = [int(torch.nonzero(allowed)[0])]
            elif not bool(allowed[proposal[position]]):
                break
        taken = 0
        for token in forced or [int(proposal[position])]:
            if (position >= block_size or matcher.is_terminated()
                    or not matcher.accept_token(token)):
                break
            candidates[position] = token
            if forced:
                trust[position] = 1.0
            walked[position] = True
            accepted += 1
            position += 1
            taken += 1
        if taken < len(forced or [0]):
            break
    matcher.rollback(accepted)
    return walked
