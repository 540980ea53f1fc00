"""Where a request's positions fall into blocks: the one place positions map to blocks, used
by the scheduler and the runner alike. ``BlockGeometry``: block-causal, the current block
``[F // B * B, + B)`` for F known tokens; ``CanvasGeometry``: full attention.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    block_size: int

    def block_start(self, num_tokens: int) -> int:
        """Start of the block holding the next undecided position."""
        return num_tokens // self.block_size * self.block_size

    def block_end(self, num_tokens: int) -> int:
        return self.block_start(num_tokens) + self.block_size

    def step_end(self, num_prompt: int, num_tokens: int, max_tokens: int) -> int:
        """One past the last position a step computes for a request: its block's end."""
        return self.block_end(num_tokens)

    def reaches_block(self, num_computed: int, num_scheduled: int, num_tokens: int) -> bool:
        """Whether a step scheduling ``[num_computed, + num_scheduled)`` denoises the block
        (otherwise it is a partial prefill chunk)."""
        return num_computed + num_scheduled >= num_tokens

    def committed_after_step(self, num_computed: int, num_scheduled: int,
                             num_tokens: int) -> int:
        """The committed prefix once such a step ran."""
        if self.reaches_block(num_computed, num_scheduled, num_tokens):
            return self.block_start(num_tokens)
        return self.block_start(num_computed + num_scheduled)

    def check_committed(self, req_id: str, num_computed: int) -> None:
        if num_computed % self.block_size:
            raise RuntimeError(
                f"request {req_id}: committed prefix {num_computed} is not on a diffusion "
                f"block boundary ({self.block_size})")


@dataclasses.dataclass(frozen=True)
class CanvasGeometry:
    """Full attention: a request's prompt (P tokens) and a canvas of masks after it, all
    computed every step (``[0, canvas end)``, nothing committed) except under an
    approximate cache (``computed_rows``). Decoded in blocks ``[P + k B, P + (k + 1) B)``;
    the canvas holds ``max_tokens`` positions (the published ``gen_length``) but reaches
    at most ``canvas_tokens`` past the current block's start (sliding ahead block by
    block) and never past ``max_model_len``; a last block's positions past the canvas's
    end are decided there, neither computed nor output."""

    block_size: int
    canvas_tokens: int  # a multiple of block_size
    max_model_len: int
    # Fast-dLLM's approximate caches (``capabilities.CACHE_MODES``): which rows a step
    # after a block's first computes; the first (and one after a preemption) computes all
    cache_mode: str = "recompute"

    def computed_rows(self, block_start: int, block_end: int, end: int,
                      refresh: bool) -> range:
        """The positions a step computes: ``[0, end)`` where it refreshes the KV (every
        step under ``recompute``); else the block and the canvas after it (``prefix``) or
        the block alone (``dual``), against the KV the block's refresh wrote."""
        if refresh or self.cache_mode == "recompute":
            return range(0, end)
        return range(block_start, end if self.cache_mode == "prefix" else block_end)

    def block_start(self, num_prompt: int, num_tokens: int) -> int:
        """Start of the block holding the next undecided position."""
        return num_prompt + (num_tokens - num_prompt) // self.block_size * self.block_size

    def step_end(self, num_prompt: int, num_tokens: int, max_tokens: int) -> int:
        """One past the canvas's last position this step."""
        return min(num_prompt + max_tokens,
                   self.block_start(num_prompt, num_tokens) + self.canvas_tokens,
                   self.max_model_len)


def step_geometry(attention: str, block_size: int, canvas_tokens: int, max_model_len: int,
                  cache_mode: str = "recompute") -> BlockGeometry | CanvasGeometry:
    """The geometry of the served model's attention regime (``ModelCapabilities.attention``)."""
    if attention == "full":
        return CanvasGeometry(block_size, canvas_tokens, max_model_len, cache_mode)
    return BlockGeometry(block_size)
