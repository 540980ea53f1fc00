"""Block geometry of a block-diffusion request: the one place positions map to blocks.

For a request with known tokens F (prompt plus emitted output) and block size B, the
current block is ``[F // B * B, F // B * B + B)``; a step that schedules ``[C, C + N)``
either reaches the known tokens (it commits everything before the current block and
denoises that block) or is a partial prefill chunk (it commits its whole blocks only).
The scheduler sizes steps and the runner plans them with these same functions.
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
