"""Where a request's positions fall into blocks: the one place positions map to blocks.

``BlockGeometry`` (block-causal attention):

For a request with known tokens F (prompt plus emitted output) and block size B, the
current block is ``[F // B * B, F // B * B + B)``; a step that schedules ``[C, C + N)``
either reaches the known tokens (it commits everything before the current block and
denoises that block) or is a partial prefill chunk (it commits its whole blocks only).
The scheduler sizes steps and the runner plans them with these same functions.

``CanvasGeometry`` (full attention): see its docstring.
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
    """Full attention: a request's sequence is its prompt (P tokens) and a canvas of masks
    after it, every position attending to every other, so every step computes the whole
    sequence ``[0, canvas end)`` and nothing is committed (no KV is reused: the published
    loops recompute it all), except under an approximate cache (``computed_rows``). The canvas is decoded in blocks of ``block_size`` from the
    prompt's end (``[P + k B, P + (k + 1) B)``, LLaDA's semi-autoregressive blocks); the
    canvas holds ``max_tokens`` positions (the published ``gen_length``), but reaches at
    most ``canvas_tokens`` past the current block's start (a longer output decodes with
    the canvas sliding ahead block by block) and never past ``max_model_len``; a last
    block reaching past the canvas's end is decided there (those positions are neither
    computed nor output)."""

    block_size: int
    canvas_tokens: int  # a multiple of block_size
    max_model_len: int
    # Fast-dLLM's approximate caches (``capabilities.CACHE_MODES``): which rows a step
    # after a block's first computes; the first (and one after a preemption) computes all
    cache_mode: str = "recompute"

    def computed_rows(self, block_start: int, block_end: int, end: int,
                      refresh: bool) -> range:
        """The positions a step computes: the whole sequence ``[0, end)`` where it
        refreshes the KV (every step under ``recompute``); else the block and the canvas
        after it (``prefix``) or the block alone (``dual``), against the KV the block's
        refresh wrote for the other positions."""
        if refresh or self.cache_mode == "recompute":
            return range(0, end)
        return range(block_start, end if self.cache_mode == "prefix" else block_end)

    def block_start(self, num_prompt: int, num_tokens: int) -> int:
        """Start of the block holding the next undecided position (``num_tokens``: prompt
        plus emitted output)."""
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
