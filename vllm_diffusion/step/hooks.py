"""What a step's forward hooks see and answer: the model's layers call the hook points a policy
declares (``LayerHooks``) with a ``LayerInput``; a hook answers with the rows that continue
(``RowSelection``) or the keys each request's block rows see (``keys.KeySelection``;
``preselect_keys``: made before the forward, so a step declaring nothing else runs the
model whole). What an attention selected returns through ``after_key_scoring``.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.step.keys import KeySelection, SelectedPrefix
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class LayerHooks:
    """The layers at which a step's hooks run (layer indices of the model)."""

    before_attention: tuple[int, ...] = ()
    after_output: tuple[int, ...] = ()
    select_keys: tuple[int, ...] = ()
    # layers whose key selection is made before the forward (``preselected_keys``); it
    # indexes the step's rows, so no hook may drop rows before such a layer
    preselect_keys: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        both = set(self.select_keys) & set(self.preselect_keys)
        if both:
            raise ValueError(f"hooks declare layers {sorted(both)} both in select_keys and "
                             f"in preselect_keys; a layer's keys are selected one way")

    @property
    def between_layers(self) -> bool:
        """Whether any hook runs inside the forward (then the layers run as pieces)."""
        return bool(self.before_attention or self.after_output or self.select_keys)


@dataclasses.dataclass
class StepRequest:
    """One request of a step as the forward hooks see it."""

    request: DiffusionRequest | None  # None: prefill-only rows (no block this step)
    rows: range  # its query rows in the step
    block_rows: torch.Tensor | None  # [n] query rows of its computed block positions
    block_positions: torch.Tensor | None  # [n] block-relative positions of those rows
    key_end: int = 0  # one past its last key this step (full attention: the canvas's end)
    # rows before its block position a block position's logits are read from (1: shifted
    # logits; a block row's own position is its block position minus this)
    logits_shift: int = 0

    @property
    def block_only(self) -> bool:
        """Whether its rows are exactly its computed block positions (a full-attention
        step under a cache that reads every other position's KV from it)."""
        return self.block_rows is not None and len(self.rows) == len(self.block_rows)


@dataclasses.dataclass
class ForwardStep:
    requests: list[StepRequest]
    num_rows: int
    device: torch.device


@dataclasses.dataclass
class RowSelection:
    """Rows that continue past a hook."""

    keep: torch.Tensor  # [T] bool (host) over the rows that entered the layer
    # request index -> its new key length from this layer's attention on (others keep theirs)
    kv_lens: dict[int, int] | None = None


@dataclasses.dataclass
class LayerInput:
    """What a hook reads. ``rows``: [T'] step rows (original indices) entering the layer;
    ``query`` [T', H, D] and ``key`` [T', H_kv, D] after q/k-norm and RoPE (attention
    hooks) or ``hidden`` [T', hidden], the layer's output in the residual stream (output
    hooks); ``scale``: the attention scale."""

    layer: int
    rows: torch.Tensor
    query: torch.Tensor | None = None
    key: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    scale: float = 1.0

    def current_rows(self, step_rows: torch.Tensor) -> torch.Tensor:
        """Indices, among the rows entering this layer, of the step rows ``step_rows``
        (all of which must still be present)."""
        if not len(self.rows) or len(self.rows) == int(self.rows[-1]) + 1:
            return step_rows  # no row dropped yet (rows ascend)
        index = torch.full((int(self.rows[-1]) + 1,), -1, dtype=torch.long)
        index[self.rows] = torch.arange(len(self.rows))
        current = index[step_rows]
        if bool((current < 0).any()):
            raise RuntimeError("a hook asked for rows an earlier hook dropped")
        return current


class StepHooks:
    """A step's forward hooks; the defaults keep every row and every key."""

    layers: LayerHooks = LayerHooks()

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        return None

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        return None

    def select_keys(self, layer_input: LayerInput) -> KeySelection | None:
        """The layer's key selection; None: every request attends densely."""
        return None

    def preselected_keys(self, layer: int) -> KeySelection | None:
        """A ``preselect_keys`` layer's key selection, made before the forward (None: dense)."""
        return None

    def after_key_scoring(self, layer: int, selected: SelectedPrefix) -> None:
        """The prefix positions a layer's attention selected for its scoring requests
        (``KeySelection.scoring``), after that attention (preselected: after the forward)."""
