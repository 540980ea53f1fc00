"""What every family's model shares around its layers: the pre-norm layer body with the
step run's hook points, a SwiGLU MLP, the layer loop, and the ``ForCausalLM`` module (LM
head, logits, weight loading)."""

from __future__ import annotations

from itertools import islice

import torch
import torch.nn as nn

from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from vllm_diffusion.models.layer_segments import segments_for
from vllm_diffusion.models.step_run import StepRun


class PreNormHalves:
    """A pre-norm residual layer (``input_layernorm`` -> attention ->
    ``post_attention_layernorm`` -> ``mlp``, vLLM's fused add-and-norm) in its two halves
    around the attention (the attribute ``attention_name``). A step without hooks runs
    ``forward``; a step with hooks runs the halves, its hook points between them
    (``layer_segments``)."""

    attention_name = "self_attn"

    @property
    def attention_module(self) -> nn.Module:
        return getattr(self, self.attention_name)

    def attention_inputs(self, positions: torch.Tensor, hidden: torch.Tensor,
                         residual: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The norm and the attention's projections; returns (q, k, v, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.attention_module.project(positions, hidden)
        return q, k, v, residual

    def attention_output(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention, the norm and the MLP; returns (hidden, residual)."""
        hidden = self.attention_module.attend(q, k, v)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(positions, hidden), residual

    def feed_forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's MLP (a family whose MLP needs the rows' positions overrides this)."""
        return self.mlp(hidden)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention_output(positions,
                                     *self.attention_inputs(positions, hidden, residual))


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate) * up)``, the gate and the up packed in ``gate_up_proj``
    (shards 0 and 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 vllm_config: VllmConfig, prefix: str, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           quant_config=vllm_config.quant_config,
                                           reduce_results=reduce_results,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


def run_layers(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
               run: StepRun | None) -> torch.Tensor:
    """Embedding, the decoder layers, the final norm (no pipeline parallelism). With a run,
    the layers between its hook points run as pieces (``layer_segments``; compiled unless
    the engine is eager), the hooks between them."""
    layers = islice(model.layers, model.start_layer, model.end_layer)
    if run is not None:
        segments = segments_for(model, list(layers), run.declared, run.compiled)
        return segments.run(run, positions, input_ids)
    hidden, residual = model.embed_input_ids(input_ids), None
    for layer in layers:
        hidden, residual = layer(positions, hidden, residual)
    hidden, _ = model.norm(hidden, residual)
    return hidden


class DiffusionCausalLM(nn.Module):
    """A family's ``ForCausalLM``: ``model_cls`` (whose ``forward`` takes ``stack_run``),
    the LM head (tied to ``embedding_name`` of the model when the config says so), logits
    and weight loading (with ``hf_to_vllm_mapper`` where the checkpoint's names differ)."""

    model_cls: type[nn.Module]
    embedding_name: str = "embed_tokens"
    hf_to_vllm_mapper: WeightsMapper | None = None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise NotImplementedError("block-diffusion models do not support pipeline "
                                      "parallelism")
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        self.model = self.model_cls(vllm_config=vllm_config,
                                    prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(getattr(self.model, self.embedding_name))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, stack_run=stack_run)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
