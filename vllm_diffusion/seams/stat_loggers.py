"""vLLM's stat loggers: the diffusion metric names for the plugin's models (patches/README.md
row 7). ``DiffusionPrometheusStatLogger`` (entry point ``vllm.stat_logger_plugins``) exports
vLLM's diffusion counters and the plugin's own (``metrics.decode_counters``); vLLM's
default logging logger, which a plugin cannot replace, is wrapped to log them as steps.
"""

from __future__ import annotations

from vllm.v1.metrics import loggers
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm

from vllm_diffusion.metrics import decode_counters
from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model

# vLLM 0.32 labels every per-engine metric with these.
_LABELS = ["model_name", "engine"]


class DiffusionSpecDecodingProm(SpecDecodingProm):
    """vLLM's diffusion counters plus the plugin's own."""

    def __init__(self, per_engine_labelvalues) -> None:
        super().__init__(None, _LABELS, per_engine_labelvalues, is_diffusion=True)
        self.engine_labels = per_engine_labelvalues
        self.later_layers = self._engine_counter(
            "vllm:diffusion_num_positions_after_eviction",
            "Block positions computed by the layers after the policy's eviction point "
            "(layers 2+; equal to the canvas positions when nothing is evicted).")
        self.matcher_fills = self._engine_counter(
            "vllm:diffusion_num_grammar_fills",
            "Structured output: grammar bitmask fills (one per position a step walks).")
        self.matcher_accepts = self._engine_counter(
            "vllm:diffusion_num_grammar_accepts",
            "Structured output: tokens advanced through the runner's grammar matchers "
            "(walks and emitted tokens).")
        self.chunk_steps = self._counter_cls(
            name="vllm:diffusion_chosen_chunk_steps",
            documentation="Steps by the chunk size an adaptive policy (elastic) chose for "
                          "them (label 'chunk').",
            labelnames=[*_LABELS, "chunk"])
        self.token_edits = self._counter_cls(
            name="vllm:diffusion_num_token_edits",
            documentation="Token edits (LLaDA2.1 / 2.2 editing) by kind (label 'kind': "
                          "substitution, deletion, split).",
            labelnames=[*_LABELS, "kind"])
        self.per_layer = self._counter_cls(
            name="vllm:diffusion_num_layer_positions",
            documentation="Block positions whose queries each layer computed (label "
                          "'layer'); lower in later layers when a policy drops rows.",
            labelnames=[*_LABELS, "layer"])

    def _engine_counter(self, name: str, documentation: str):
        return create_metric_per_engine(
            self._counter_cls(name=name, documentation=documentation, labelnames=_LABELS),
            self.engine_labels)

    def observe(self, spec_decoding_stats, engine_idx: int = 0) -> None:
        super().observe(spec_decoding_stats, engine_idx)
        counters = decode_counters(spec_decoding_stats)
        if counters is None:
            return
        self.later_layers[engine_idx].inc(counters.positions_after_eviction)
        self.matcher_fills[engine_idx].inc(counters.matcher_fills)
        self.matcher_accepts[engine_idx].inc(counters.matcher_accepts)
        if counters.chosen_chunk:
            self.chunk_steps.labels(*self.engine_labels[engine_idx],
                                    str(counters.chosen_chunk)).inc()
        for kind, count in zip(("substitution", "deletion", "split"), counters.token_edits):
            if count:
                self.token_edits.labels(*self.engine_labels[engine_idx], kind).inc(count)
        for layer, count in enumerate(counters.layer_positions):
            self.per_layer.labels(*self.engine_labels[engine_idx], str(layer)).inc(count)


class DiffusionPrometheusStatLogger(loggers.PrometheusStatLogger):
    """vLLM's Prometheus logger; for the plugin's models with the diffusion counters."""

    def __init__(self, vllm_config, engine_indexes=None) -> None:
        super().__init__(vllm_config, engine_indexes)
        if serves_diffusion_model(vllm_config):
            self.spec_decoding_prom = DiffusionSpecDecodingProm(self.per_engine_labelvalues)


def install() -> None:
    if not first_wrap(loggers.LoggingStatLogger):
        return
    logging_init = loggers.LoggingStatLogger.__init__

    def logging_stat_logger_init(self, vllm_config, *args, **kwargs):
        logging_init(self, vllm_config, *args, **kwargs)
        if serves_diffusion_model(vllm_config):
            self.spec_decoding_logging = SpecDecodingLogging(is_diffusion=True)

    loggers.LoggingStatLogger.__init__ = logging_stat_logger_init
