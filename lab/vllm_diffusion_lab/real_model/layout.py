"""Training batches of the conversion: each example laid out as ``[clean | noisy A | noisy
B]`` with the attention each row sees and the rows each target is read from
(``conversion.py`` says why)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_diffusion_lab.real_model.conversion import MASK_TOKEN_ID, STOP_TOKEN_ID


@dataclass
class Batch:
    ids: torch.Tensor        # [batch, 3 * length] clean, noisy A, noisy B
    positions: torch.Tensor  # [batch, 3 * length]
    visible: torch.Tensor    # [batch, 3L, 3L] bool: query row sees key row
    read_rows: torch.Tensor  # [targets, 2] (example, row) whose logits predict a target
    targets: torch.Tensor    # [targets]
    from_clean: torch.Tensor  # [targets] bool: the target is a block-first position


def padded_sequence(prompt_ids: list[int], answer_ids: list[int], block_size: int,
                    max_length: int) -> tuple[list[int], int] | None:
    """Prompt, answer and stop tokens to the end of the stop token's block (the answer cut
    to ``max_length``), and the answer's start; None when the prompt leaves no room."""
    tokens = list(prompt_ids) + list(answer_ids)
    if not answer_ids or answer_ids[-1] != STOP_TOKEN_ID:
        tokens = tokens[:max_length]
    else:
        end = -(-len(tokens) // block_size) * block_size
        tokens = (tokens + [STOP_TOKEN_ID] * (end - len(tokens)))[:max_length]
    if len(tokens) <= len(prompt_ids) + 1:
        return None
    return tokens, len(prompt_ids)


def visibility(length: int, valid: int, block_size: int) -> torch.Tensor:
    """[3L, 3L] bool for one example of ``valid`` real rows in each copy of ``length``."""
    block = torch.arange(length) // block_size
    clean_sees_clean = block[None, :] <= block[:, None]
    noisy_sees_clean = block[None, :] < block[:, None]
    noisy_sees_noisy = block[None, :] == block[:, None]
    real = torch.arange(length) < valid
    none = torch.zeros(length, length, dtype=torch.bool)
    rows = [torch.cat((clean_sees_clean, none, none), 1),
            torch.cat((noisy_sees_clean, noisy_sees_noisy, none), 1),
            torch.cat((noisy_sees_clean, none, noisy_sees_noisy), 1)]
    seen = torch.cat(rows, 0) & real.repeat(3)[None, :]
    # rows past the example see the first key only (no loss is read from them)
    padding = ~real.repeat(3)
    seen[padding] = False
    seen[padding, 0] = True
    return seen


def make_batch(examples: list[tuple[list[int], int]], block_size: int,
               generator: torch.Generator) -> Batch:
    """Batch of (tokens, answer start) with complementary random masks."""
    length = -(-max(len(t) for t, _ in examples) // block_size) * block_size
    ids, visible, read_rows, targets, from_clean = [], [], [], [], []
    for e, (tokens, answer_start) in enumerate(examples):
        n = len(tokens)
        clean = torch.full((length,), STOP_TOKEN_ID, dtype=torch.long)
        clean[:n] = torch.tensor(tokens)
        pos = torch.arange(length)
        answer = (pos >= answer_start) & (pos < n)
        block_first = answer & (pos % block_size == 0)
        maskable = answer & ~block_first
        ratio = torch.rand((), generator=generator) * 0.9 + 0.05
        in_a = maskable & (torch.rand(length, generator=generator) < ratio)
        in_b = maskable & ~in_a
        noisy_a = torch.where(in_a, MASK_TOKEN_ID, clean)
        noisy_b = torch.where(in_b, MASK_TOKEN_ID, clean)
        ids.append(torch.cat((clean, noisy_a, noisy_b)))
        visible.append(visibility(length, n, block_size))
        for copy, chosen in ((0, block_first), (1, in_a), (2, in_b)):
            where = chosen.nonzero().flatten()
            read_rows.append(torch.stack((torch.full_like(where, e),
                                          copy * length + where - 1), 1))
            targets.append(clean[where])
            from_clean.append(torch.full_like(where, copy == 0, dtype=torch.bool))
    positions = torch.arange(length).repeat(3)[None].expand(len(examples), -1)
    return Batch(torch.stack(ids), positions.contiguous(), torch.stack(visible),
                 torch.cat(read_rows), torch.cat(targets), torch.cat(from_clean))


def batch_loss(model, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean cross-entropy over every target, and its two parts for the log."""
    hidden = model.hidden(batch.ids, batch.positions, batch.visible)
    rows = hidden[batch.read_rows[:, 0], batch.read_rows[:, 1]]
    losses = torch.nn.functional.cross_entropy(model.logits(rows), batch.targets,
                                               reduction="none")
    clean, masked = losses[batch.from_clean], losses[~batch.from_clean]
    parts = {"block_first": clean.mean().item() if len(clean) else float("nan"),
             "masked": masked.mean().item() if len(masked) else float("nan"),
             "targets": float(len(losses))}
    return losses.mean(), parts
