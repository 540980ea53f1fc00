"""The forward of one diffusion step: the planned rows through the model, once
(``ModelForward``), returning the hidden states of the rows that reached the last layer.
See docs/architecture.md, "Runner".
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.models.utils import extract_layer_index

from vllm_diffusion.attention.backend import attention_planner
from vllm_diffusion.models.step_run import (LayerViews, StepRun, hand_selected,
                                            publish_preselected_keys)
from vllm_diffusion.step.hooks import ForwardStep, StepHooks
from vllm_diffusion.step.rows import StepRows
from vllm_diffusion.worker.outputs import DiffusionStats
from vllm_diffusion.worker.step_plan import RequestRows, step_inputs


class ModelForward:
    """Runs the steps' forwards of one runner (the model is given at each step). Built at
    the runner's first step (the KV cache is configured after the runner is)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, device: torch.device,
                 diffusion: Any, stats: DiffusionStats) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.stats = stats
        self.page_size = vllm_config.cache_config.block_size
        self.compiled = not vllm_config.model_config.enforce_eager
        self.row_buckets = diffusion.row_buckets
        self.num_layers = vllm_config.model_config.hf_config.num_hidden_layers
        # the spans whose rows attend to each other (the block, or the whole sequence)
        self.attention_span = diffusion.model.attention_span(
            diffusion.block_size, vllm_config.model_config.max_model_len)
        # the attention layers' names by layer index, and the attention's step planner
        names = sorted((name for group in kv_cache_config.kv_cache_groups
                        for name in group.layer_names), key=extract_layer_index)
        if [extract_layer_index(name) for name in names] != list(range(len(names))):
            raise RuntimeError(f"expected one attention layer per model layer, got {names}")
        self.layer_names = names
        self.planner = attention_planner(
            vllm_config.compilation_config.static_forward_context[names[0]])

    def run(self, model: Any, rows: list[RequestRows], step: ForwardStep,
            hooks: StepHooks | None, page_ids: list[list[int]]
            ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Hidden states of the rows that reached the last layer, those rows (step row
        indices), and the block rows each layer computed."""
        device = self.device
        inputs = step_inputs(rows, page_ids, self.page_size)
        positions = inputs.positions.to(device)
        step_rows = StepRows(query_positions=positions, slot_mapping=inputs.slots.to(device),
                             query_start_loc=inputs.query_start_loc, kv_lens=inputs.kv_lens)
        views = LayerViews(self.layer_names, inputs.block_table.to(device),
                           self.attention_span, self.planner)
        # Without hooks between layers: the model as vLLM built it, every layer reading one
        # view; with them: pieces between the hooks' layers (``models/layer_segments.py``).
        run, selected = None, None
        if hooks is None:
            views.publish(views.view(step_rows, planned=True), 0)
        elif not hooks.layers.between_layers:
            selected = publish_preselected_keys(hooks, step_rows, views)
        else:
            block_rows = torch.zeros(step.num_rows, dtype=torch.bool)
            for s in step.requests:
                if s.block_rows is not None:
                    block_rows[s.block_rows] = True
            run = StepRun(hooks, block_rows, step_rows, views, compiled=self.compiled,
                          row_buckets=self.row_buckets)
        token_ids = inputs.token_ids.to(device)
        with set_forward_context(views.by_name, self.vllm_config, num_tokens=len(positions),
                                 slot_mapping={}, skip_compiled=run is not None):
            if run is None:
                hidden_states = model(input_ids=token_ids, positions=positions)
            else:
                hidden_states = model(input_ids=token_ids, positions=positions,
                                      stack_run=run)
        if selected:
            hand_selected(hooks, selected)
        stats = self.stats
        stats.positions_computed += len(positions)
        stats.commits_reused += sum(r.reused_commit for r in rows)
        stats.kv_refreshes += sum(r.kv_refresh for r in rows)
        stats.bucket_padding_rows += run.padding_rows if run is not None else 0
        counts = (run.layer_block_rows if run is not None else
                  [sum(len(s.block_rows) for s in step.requests if s.block_rows is not None)]
                  * self.num_layers)
        stats.add_layer_rows(counts)
        out_rows = run.rows if run is not None else torch.arange(len(positions))
        return hidden_states, out_rows, counts
