"""Sparse-dLLM (Song et al., Algorithms 4-5) with any of the standard unmasking strategies:
from step ``delay_steps`` of a block, its denoising rows attend to the context positions
the block's queries selected at that step (``kernels.sparse_prefix.select_prefix``) plus
the block; prefill and commit rows attend densely, so committed KV stays exact. The
selections are made before the forward (``LayerHooks.preselect_keys``) and come back
through ``SparsePrefixHooks.after_key_scoring``. Details: docs/policies.md, "sparse_prefix".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.kernels.sparse_prefix import KeptKV
from vllm_diffusion.options import OptionError, Rule, option, option_value
from vllm_diffusion.policies.base import BlockStart
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyPolicy
from vllm_diffusion.policies.parts.strategy_config import StrategyConfig
from vllm_diffusion.step.hooks import ForwardStep, LayerHooks, StepHooks
from vllm_diffusion.step.keys import KeyScoring, KeySelection, RowSplit, SelectedPrefix
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan
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

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Every forward computes whole blocks (only the attention's keys are selected);
        under full attention it needs the dual cache. Where logits are shifted, every
        row of the block selects and attends sparsely (``plan_step``)."""
        # at delay 0 the selecting step is the block's first, its refresh
        if option_value(cls, options, "delay_steps") == 0:
            return PolicyTraits(
                attention_regimes=("block_causal", "full"), cache_modes=(), shifted_logits=True,
                cache_modes_reason=(
                    "option 'delay_steps' 0 would select at the block's first step, which "
                    "refreshes the whole sequence's KV under the dual cache; set it to 1 "
                    "or more"))
        return PolicyTraits(
            attention_regimes=("block_causal", "full"), cache_modes=("dual",),
            shifted_logits=True, cache_modes_reason=(
                "Sparse-dLLM evicts from the KV cached outside the block, which "
                "'recompute' does not keep and 'prefix' recomputes after the block"))


@dataclasses.dataclass
class SparsePrefixState:
    """Per request: the current block's kept context positions, and per layer the store of
    their keys and values the CPU attention fills once (``KeptKV``)."""

    # [L, H_sel, k] int64 (model device), -1 where a layer has not selected yet
    kept: torch.Tensor | None = None
    kept_kv: list[KeptKV] | None = None
    # shifted logits: this step reads the block's first token from the previous block's
    # commit (dense, not one of the block's steps), and how many steps of the block did
    reads_first_token: bool = False
    first_token_steps: int = 0

    def forget_kv(self, num_layers: int) -> None:
        """The kept positions' KV is to be read anew (a new selection, or a preemption)."""
        self.kept_kv = [KeptKV() for _ in range(num_layers)]


SparsePrefixRequest = DiffusionRequest[SparsePrefixConfig, SparsePrefixState]


class SparsePrefixHooks(StepHooks):
    """A step's prefix sparsity: which requests select at every layer and which attend
    sparsely (with their kept lists stacked once for the step)."""

    def __init__(self, step: ForwardStep, num_layers: int, num_kv_heads: int,
                 scoring: list[tuple[int, SparsePrefixRequest, int]],
                 sparse: list[tuple[int, SparsePrefixRequest]]) -> None:
        self.layers = LayerHooks(preselect_keys=tuple(range(num_layers)))
        # each request's rows of its block, the last of its rows: where logits are shifted
        # the rows read run one short of them (the last row decodes the next block)
        self.block_rows = [0 if s.block_rows is None else len(s.block_rows) + s.logits_shift
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
        self.kept_kv = [request.policy_state.kept_kv for _, request in sparse]
        if sparse:
            lists = [request.policy_state.kept for _, request in sparse]
            width = max(1, max(kept.shape[2] for kept in lists))
            self.kept = torch.full((len(lists), num_layers, num_kv_heads, width), -1,
                                   dtype=torch.long, device=lists[0].device)
            for row, kept in zip(self.kept, lists):
                row[:, :, :kept.shape[2]] = kept  # a shared list broadcasts over KV heads

    def preselected_keys(self, layer: int) -> KeySelection:
        return KeySelection(self.block_rows, self.prefix_lens, self.sparse,
                            None if self.kept is None else self.kept[:, layer], self.scoring,
                            self.split, [stores[layer] for stores in self.kept_kv])

    def after_key_scoring(self, layer: int, selected: SelectedPrefix) -> None:
        """The layer's selection for each request that selects this step (after the
        forward): kept for the rest of its block."""
        for index, request in self.scoring_requests.items():
            request.policy_state.kept[layer] = selected[index]


class SparsePrefixPolicy(StrategyPolicy[SparsePrefixConfig, SparsePrefixState]):
    """Unmasks like ``standard``; the block's rows see a selected part of the context."""

    name: ClassVar[str] = "sparse_prefix"
    config_cls: ClassVar[type] = SparsePrefixConfig

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: SparsePrefixConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.num_layers = 0
        self.num_kv_heads = 0

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        if model.shifted_logits and model.attention == "full":
            raise ValueError(f"the sparse_prefix policy cannot serve {model.family}: its "
                             f"selection is served with shifted logits under block-causal "
                             f"attention only; use the standard or es policy")
        super().bind(model, hf_config, prefix_caching)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads",
                                    hf_config.num_attention_heads)

    def new_state(self, config: SparsePrefixConfig) -> SparsePrefixState:
        return SparsePrefixState()

    def plan_step(self, request: SparsePrefixRequest, start: BlockStart) -> BlockStepPlan:
        # The kept lists index context positions, whose KV a preemption recomputes: a
        # resumed block keeps them and reads their KV anew.
        state = request.policy_state
        if start == "new":
            state.kept, state.first_token_steps = None, 0
        if start is not None:
            state.forget_kv(self.num_layers)
        state.reads_first_token = (self.model.shifted_logits and
                                   int(request.canvas.tokens[0]) == self.mask_token_id)
        return WHOLE_BLOCK

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        scoring, sparse = [], []
        full_attention = self.model.attention == "full"
        for index, s in enumerate(step.requests):
            request = s.request
            if request is None or request.canvas.start == 0:
                continue  # nothing before the block: nothing to select from
            config, state = request.policy_config, request.policy_state
            if (full_attention and not s.block_only) or state.reads_first_token:
                continue  # a refresh of the whole sequence, or a commit: dense
            step_in_block = request.canvas.steps - state.first_token_steps
            if step_in_block < config.delay_steps:
                continue
            if state.kept is None:  # the block's selection step
                after_block = s.key_end - request.canvas.start - len(s.block_rows)
                context = request.canvas.start + (after_block if full_attention else 0)
                keep = math.floor(config.retention_ratio * context)
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

    def after_step(self, request: SparsePrefixRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int, block_done: bool) -> None:
        state = request.policy_state
        state.first_token_steps += int(state.reads_first_token)
        if block_done:
            state.kept = state.kept_kv = None
