"""LLaDA2.2's joint decoding of a block: mask-to-token filling and token-to-token editing
whose writes may be DELETE or SPLIT (a Levenshtein edit), as the published generation
loop does it (``joint_step``, one step of one block; ``JointBlockState``, what the loop
keeps between steps). The rules, one by one: docs/policies.md, "Where edits move tokens".
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

ANTI_LOOP_TRIES = 5
# Proposals the pipeline keeps per position: the best token and its runners-up, enough
# to find the best token outside two banned ones (DELETE and SPLIT) or outside one.
ALTERNATIVES = 3


@dataclasses.dataclass(frozen=True)
class EditTokens:
    delete: int
    split: int


@dataclasses.dataclass
class JointBlockState:
    """What the joint loop keeps for one block between its steps."""

    fixed: torch.Tensor  # [B] bool, prompt-tail positions (a prefix of the block)
    original: torch.Tensor  # [B] bool, where the block's original masks are now
    schedule: list[int]  # originals to fill at each step before the step budget
    post: int = 0  # the last step's post count
    seen: set = dataclasses.field(default_factory=set)  # block states after a step's writes
    rng: random.Random = dataclasses.field(default_factory=lambda: random.Random(0))

    @staticmethod
    def start(tokens: torch.Tensor, mask_id: int, steps: int) -> JointBlockState:
        original = tokens == mask_id
        count = int(original.sum())
        return JointBlockState(~original, original.clone(),
                               [count // steps + int(i < count % steps) for i in range(steps)])

    def copy(self) -> JointBlockState:
        """A copy that a step may change without changing this one (its tensors are
        replaced, never written, by ``joint_step``)."""
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        return dataclasses.replace(self, seen=set(self.seen), rng=rng)


@dataclasses.dataclass
class JointStep:
    """One step's outcome for one block."""

    # [B] bool, positions given a new token this step, DELETE and SPLIT writes excluded
    # (old coordinates: before the edits apply)
    changed: torch.Tensor
    tokens_written: torch.Tensor  # [B] the block with this step's writes
    deletions: int
    splits: int
    tokens: torch.Tensor  # [B] the block after the edits applied
    source: torch.Tensor  # [B] int64, each new position's old position (-1: a new mask)
    ended: bool


def apply_edits(tokens: torch.Tensor, old: torch.Tensor, original: torch.Tensor,
                edit: EditTokens, mask_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left to right: DELETE drops, SPLIT at i gives (new mask, old[i]); cut or padded
    with new masks back to the block length. Returns (tokens, original, source)."""
    out, tracked, source = [], [], []
    for i, token in enumerate(tokens.tolist()):
        if token == edit.delete:
            continue
        if token == edit.split:
            out += [mask_id, int(old[i])]
            tracked += [False, bool(original[i])]
            source += [-1, i]
        else:
            out.append(token)
            tracked.append(bool(original[i]))
            source.append(i)
    size = len(tokens)
    pad = max(0, size - len(out))
    return (torch.tensor((out + [mask_id] * pad)[:size], dtype=torch.long),
            torch.tensor((tracked + [False] * pad)[:size], dtype=torch.bool),
            torch.tensor((source + [-1] * pad)[:size], dtype=torch.long))


def best_other(alternatives: torch.Tensor, banned: set[int]) -> int:
    """The best of a position's ranked proposals ([k]) that is not banned."""
    return next(int(t) for t in alternatives.tolist() if int(t) not in banned)


def joint_step(state: JointBlockState, old: torch.Tensor, proposals: torch.Tensor,
               confidence: torch.Tensor, alternatives: torch.Tensor, step: int,
               config: Any, mask_id: int, edit: EditTokens) -> JointStep:
    """One step of the joint loop on one block (docs/policies.md, "Where edits move tokens").
    old: [B] the block; proposals, confidence: [B] greedy token and its probability;
    alternatives: [B, ALTERNATIVES] the best tokens in order; step: the block's steps so
    far; config: the request's ``parts.strategy_config.StrategyConfig``. Updates ``state``."""
    masks = (old == mask_id) & ~state.fixed
    original_left = int((masks & state.original).sum())
    mask_count = int(masks.sum())
    post = state.post + 1 if original_left == 0 else 0
    steps = len(state.schedule)
    last_allowed = step + 1 >= config.max_steps_per_block
    fill = torch.zeros_like(masks)
    if mask_count:
        if step < steps:
            need = state.schedule[step] + (mask_count - original_left)
            above = masks & (confidence > config.threshold)
            if int(above.sum()) >= need:
                fill = above
            else:
                ranked = torch.where(masks, confidence, torch.full_like(confidence,
                                                                        float("-inf")))
                order = torch.sort(ranked, descending=True, stable=True).indices
                fill[order[:min(need, mask_count)]] = True  # ties: lower position
        else:
            fill = masks.clone()
    edits = torch.zeros_like(masks)
    if config.editing_threshold is not None:
        edits = (~masks & ~state.fixed & (confidence > config.editing_threshold)
                 & (proposals != old))
    if config.max_post_steps > 0:
        final_round = post >= config.max_post_steps
    else:
        final_round = original_left > 0 and not bool((masks & state.original & ~fill).any())
    final_round = final_round or last_allowed
    if final_round:
        fill = masks.clone()
    written = fill | edits
    tokens = torch.where(written, proposals, old)
    if final_round:
        banned = {edit.delete, edit.split}
        for i in torch.nonzero(written & ((tokens == edit.delete) | (tokens == edit.split))
                               ).flatten().tolist():
            tokens[i] = best_other(alternatives[i], banned)
    elif bool(written.any()) and tuple(tokens.tolist()) in state.seen:
        for _ in range(ANTI_LOOP_TRIES):
            changed = torch.nonzero(tokens != old).flatten().tolist()
            if not changed:
                break
            i = changed[state.rng.randrange(len(changed))]
            tokens[i] = best_other(alternatives[i], {int(tokens[i])})
            if tuple(tokens.tolist()) not in state.seen:
                break
    state.seen.add(tuple(tokens.tolist()))
    new_tokens, state.original, source = apply_edits(tokens, old, state.original, edit,
                                                     mask_id)
    state.post = post
    next_masks = (new_tokens == mask_id) & ~state.fixed
    next_post = post + 1 if not bool((next_masks & state.original).any()) else 0
    ended = (not bool(next_masks.any())
             and (torch.equal(new_tokens, old) or next_post > config.max_post_steps
                  or last_allowed))
    is_edit = (tokens == edit.delete) | (tokens == edit.split)
    return JointStep(written & (tokens != old) & ~is_edit, tokens,
                     int((tokens == edit.delete).sum()), int((tokens == edit.split).sum()),
                     new_tokens, source, ended)
