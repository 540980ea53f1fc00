"""Sparse-dLLM's prefix side (Song et al., "Sparse-dLLM: Accelerating Diffusion LLMs with
Dynamic Cache Eviction", Algorithms 4-5, "Cache Implementation for Prefix-Sparse"), with
any of the standard unmasking strategies.

In a block-diffusion model nothing follows the current block, so of the paper's
bidirectional eviction only the prefix side applies. For step i (0-based) of a block that
starts at position N:

- i < ``delay_steps``: dense attention (the paper's cache state 0);
- i == ``delay_steps``: dense attention, and at every layer the block's queries select the
  prefix positions kept for the rest of the block (cache state 1): the mean query of each
  head scores the committed prefix keys (scaled dot product), the scores are averaged over
  the heads (one list per layer, as the authors' code does; ``per_kv_head``: one list per KV
  head), max-pooled with kernel ``pool_kernel``, and the top floor(``retention_ratio`` * N)
  positions are kept (``kernels.sparse_prefix.select_prefix``);
- i > ``delay_steps``: the block's rows attend to the kept prefix positions plus the block
  itself (cache state 2).

The selection is made anew for every block. The committed KV pages themselves stay (they
are shared through vLLM's prefix cache and must stay exact): only the block's denoising
rows attend sparsely; prefill and commit rows attend densely, so committed KV is exact.
The attention of each layer returns what it selected through the hooks
(``SparsePrefixHooks.after_key_scoring``), which keep it in the request's policy state
([L, H_sel, k] int64 on the model device); the lists are freed when the block completes or
the request ends.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.strategy_unmasking import StrategyPolicy
from vllm_diffusion.policies.unmasking import StrategyConfig
from vllm_diffusion.step.hooks import ForwardStep, LayerHooks, LayerInput, StepHooks
from vllm_diffusion.step.keys import KeyScoring, KeySelection, RowSplit, SelectedPrefix
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class SparsePrefixConfig(StrategyConfig):
    retention_ratio: float = option(0.5, Rule(float, low=0.0, high=1.0))
    pool_kernel: int = option(3, Rule(int, low=1, high=255))  # odd
    delay_steps: int = option(1, Rule(int, low=0, high=4096))
    per_kv_head: bool = option(False, Rule(bool))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if self.pool_kernel % 2 == 0:
            raise OptionError(f"{source}: option 'pool_kernel' must be odd (the window is "
                              f"centred on each position), got {self.pool_kernel}")


@dataclasses.dataclass
class SparsePrefixState:
    """Per request: the current block's kept prefix positions."""

    # [L, H_sel, k] int64 (model device), -1 where a layer has not selected yet
    kept: torch.Tensor | None = None


SparsePrefixRequest = DiffusionRequest[SparsePrefixConfig, SparsePrefixState]


class SparsePrefixHooks(StepHooks):
    """A step's prefix sparsity: which requests select at every layer and which attend
    sparsely (with their kept lists stacked once for the step)."""

    def __init__(self, step: ForwardStep, num_layers: int, num_kv_heads: int,
                 scoring: list[tuple[int, SparsePrefixRequest, int]],
                 sparse: list[tuple[int, SparsePrefixRequest]]) -> None:
        self.layers = LayerHooks(select_keys=tuple(range(num_layers)))
        self.block_rows = [0 if s.block_rows is None else len(s.block_rows)
                           for s in step.requests]
        self.prefix_lens = [0 if s.request is None else s.request.canvas.start
                            for s in step.requests]
        # The requests that select at every layer this step, by index in the step
        self.scoring_requests = {index: request for index, request, _ in scoring}
        self.scoring = tuple(KeyScoring(index, keep, request.policy_config.pool_kernel,
                                        request.policy_config.per_kv_head)
                             for index, request, keep in scoring)
        self.sparse = [index for index, _ in sparse]
        # The same rows attend sparsely at every layer: split them once for the step.
        self.split = RowSplit.of([0] + [s.rows.stop for s in step.requests], self.block_rows,
                                 self.sparse, step.device) if sparse else None
        self.kept = None  # [R_sparse, L, H_kv, K] int64
        if sparse:
            lists = [request.policy_state.kept for _, request in sparse]
            width = max(1, max(kept.shape[2] for kept in lists))
            self.kept = torch.full((len(lists), num_layers, num_kv_heads, width), -1,
                                   dtype=torch.long, device=lists[0].device)
            for row, kept in zip(self.kept, lists):
                row[:, :, :kept.shape[2]] = kept  # a shared list broadcasts over KV heads

    def select_keys(self, layer_input: LayerInput) -> KeySelection:
        layer = layer_input.layer
        return KeySelection(self.block_rows, self.prefix_lens, self.sparse,
                            None if self.kept is None else self.kept[:, layer], self.scoring,
                            self.split)

    def after_key_scoring(self, layer: int, selected: SelectedPrefix) -> None:
        """The layer's selection for each request that selects this step: kept for the
        rest of its block."""
        for index, request in self.scoring_requests.items():
            request.policy_state.kept[layer] = selected[index]


class SparsePrefixPolicy(StrategyPolicy[SparsePrefixConfig, SparsePrefixState]):
    """Unmasks like ``standard``; the block's rows see a selected part of the prefix."""

    name: ClassVar[str] = "sparse_prefix"
    config_cls: ClassVar[type] = SparsePrefixConfig

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: SparsePrefixConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.num_layers = 0
        self.num_kv_heads = 0

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads",
                                    hf_config.num_attention_heads)

    def new_state(self, config: SparsePrefixConfig) -> SparsePrefixState:
        return SparsePrefixState()

    def start_block(self, request: SparsePrefixRequest, resumed: bool) -> None:
        # The kept lists index committed prefix positions, whose KV a preemption
        # recomputes exactly: a resumed block keeps them.
        if not resumed:
            request.policy_state.kept = None

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        scoring, sparse = [], []
        for index, s in enumerate(step.requests):
            request = s.request
            if request is None or request.canvas.start == 0:
                continue  # nothing before the block: nothing to select from
            config, state = request.policy_config, request.policy_state
            step_in_block = request.canvas.steps
            if step_in_block < config.delay_steps:
                continue
            if state.kept is None:  # the block's selection step
                keep = math.floor(config.retention_ratio * request.canvas.start)
                heads = self._local_kv_heads() if config.per_kv_head else 1
                state.kept = torch.full((self.num_layers, heads, keep), -1, dtype=torch.long,
                                        device=step.device)
                scoring.append((index, request, keep))
            else:
                sparse.append((index, request))
        if not scoring and not sparse:
            return None
        return SparsePrefixHooks(step, self.num_layers, self._local_kv_heads(), scoring,
                                 sparse)

    def _local_kv_heads(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return max(1, self.num_kv_heads // get_tensor_model_parallel_world_size())

    def on_block_complete(self, request: SparsePrefixRequest) -> None:
        request.policy_state.kept = None
