"""The rows a step's forward is computing now: ``StepRows``.

The runner makes one per step with every planned row; the attention of each layer reads
it (through ``BlockDiffusionMetadata.rows``). When a hook drops rows, the step's run object
(``models/step_run.py``) narrows it: ``keep_queries`` before the layer's attention (that
layer still stores every row's keys/values), ``keep_keys`` after it: at once, or, for a
drop before an attention, by that attention once it has stored the layer's keys
(``keys_after_attention``, then ``finish_attention``), so that no hook has to run between a
layer's attention and what follows it. Inside attention, ``key_selection`` is the current
layer's key selection, if any; ``attention_plan`` is the step-fixed part of the CPU
attention (made at the first layer, kept until rows drop).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.step.keys import KeySelection


@dataclasses.dataclass
class StepRows:
    query_positions: torch.Tensor  # [T] absolute positions of the query rows (model device)
    slot_mapping: torch.Tensor  # [T_kv] KV slot of each key row, -1 = not stored
    query_start_loc: list[int]  # R + 1 row offsets per request (host)
    kv_lens: list[int]  # R: keys [0, kv_len) are visible to request r (host)
    key_selection: KeySelection | None = None  # the current layer's (None: dense)
    attention_plan: Any = None  # the CPU attention's per-step plan, for these rows
    # [T_kv] bool (host): the key rows to keep once the current layer's attention stored
    # its keys (None: keep them all)
    keys_after_attention: torch.Tensor | None = None

    @property
    def num_queries(self) -> int:
        return len(self.query_positions)

    def keep_queries(self, keep: torch.Tensor, kv_lens: dict[int, int]) -> None:
        """Keep the query rows where ``keep`` ([T] bool, host) is set, and give the named
        requests new key lengths; key rows are unchanged until ``keep_keys``."""
        keep_rows = torch.nonzero(keep).flatten().to(self.query_positions.device)
        self.attention_plan = None
        self.query_positions = self.query_positions[keep_rows]
        counts = [int(keep[a:b].sum()) for a, b in
                  zip(self.query_start_loc[:-1], self.query_start_loc[1:])]
        self.query_start_loc = [0]
        for count in counts:
            self.query_start_loc.append(self.query_start_loc[-1] + count)
        for request, kv_len in kv_lens.items():
            self.kv_lens[request] = kv_len

    def finish_attention(self) -> None:
        """After a layer's attention stored its keys: apply ``keys_after_attention``."""
        if self.keys_after_attention is not None:
            self.keep_keys(self.keys_after_attention)
            self.keys_after_attention = None

    def keep_keys(self, keep: torch.Tensor) -> None:
        """Keep the key rows where ``keep`` ([T_kv] bool, host) is set."""
        self.slot_mapping = self.slot_mapping[torch.nonzero(keep).flatten()
                                              .to(self.slot_mapping.device)]
