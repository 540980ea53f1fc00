"""The rows a step's forward is computing now: ``StepRows``, owned by the step's run
(``models/step_run.py``) or its forward. Narrowing (``keep_queries``, ``keep_keys``)
replaces fields, never changes them in place, so an attention's view made earlier keeps
its rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class StepRows:
    query_positions: torch.Tensor  # [T] absolute positions of the query rows (model device)
    slot_mapping: torch.Tensor  # [T_kv] KV slot of each key row, -1 = not stored
    query_start_loc: Sequence[int]  # R + 1 row offsets per request (host; kept as a tuple)
    kv_lens: Sequence[int]  # R: keys [0, kv_len) are visible to request r (host; a tuple)

    def __post_init__(self) -> None:
        self.query_start_loc = tuple(self.query_start_loc)
        self.kv_lens = tuple(self.kv_lens)

    @property
    def num_queries(self) -> int:
        return len(self.query_positions)

    def keep_queries(self, keep: torch.Tensor, kv_lens: dict[int, int]) -> None:
        """Keep the query rows where ``keep`` ([T] bool, host) is set, and give the named
        requests new key lengths; key rows are unchanged until ``keep_keys``."""
        keep_rows = torch.nonzero(keep).flatten().to(self.query_positions.device)
        self.query_positions = self.query_positions[keep_rows]
        counts = [int(keep[a:b].sum()) for a, b in
                  zip(self.query_start_loc[:-1], self.query_start_loc[1:])]
        self.query_start_loc = tuple(itertools.accumulate(counts, initial=0))
        if kv_lens:
            self.kv_lens = tuple(kv_lens.get(r, kv_len) for r, kv_len in enumerate(self.kv_lens))

    def keep_keys(self, keep: torch.Tensor) -> None:
        """Keep the key rows where ``keep`` ([T_kv] bool, host) is set."""
        self.slot_mapping = self.slot_mapping[torch.nonzero(keep).flatten()
                                              .to(self.slot_mapping.device)]
