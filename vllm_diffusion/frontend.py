"""Where vllm-diffusion wraps vLLM's front end (listed in patches/README.md).

1. ``--diffusion-policy NAME`` on the ``vllm`` command line, stored into
   ``additional_config["diffusion_policy"]``.
2. Request admission for block-diffusion models: unsupported sampling parameters, invalid
   per-request policy options and prompts containing the mask token are rejected with a
   ``VLLMValidationError`` (HTTP 400), before the request reaches the engine.
3. Metric names: the scheduler reports denoising steps / canvas positions / committed
   tokens through vLLM's spec-decoding counters, as vLLM's native diffusion models do;
   the stat loggers are told to log and export them under vLLM's diffusion names
   (``vllm:diffusion_num_denoising_steps`` ...), which ``vllm bench serve`` reads.
4. Step maps: when a stop string ends the output inside a step, the detokenizer drops the
   surplus tokens; the request's step map (``kv_transfer_params["diffusion_step_map"]``,
   one entry per output token) is cut to match.
5. Offline recovery: when ``LLM.generate`` (or any call that runs the in-process engine)
   raises, the requests it left unfinished are aborted, so their KV pages and diffusion
   state are freed and the next call starts clean instead of resuming half-stepped
   requests.
6. Shutdown with requests in flight: vLLM's ``AsyncLLM.shutdown`` stops the engine and
   cancels its output handler without telling the requests still streaming, so each
   stream (and with it uvicorn's graceful shutdown) waits until its client gives up. The
   wrapper ends every in-flight request with ``EngineDeadError`` once the engine is down.
The wrappers leave every other model untouched.
"""

from __future__ import annotations

from typing import Any

_INSTALLED_FLAG = "_vllm_diffusion_wrapped"


def install() -> None:
    _install_cli_flag()
    _install_request_validation()
    _install_diffusion_metric_names()
    _install_step_map_trimming()
    _install_offline_recovery()
    _install_shutdown_notice()


def _install_cli_flag() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, _INSTALLED_FLAG, False):
        return
    setattr(EngineArgs, _INSTALLED_FLAG, True)
    original_add_cli_args = EngineArgs.add_cli_args
    original_from_cli_args = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser):
        from vllm_diffusion.policies import POLICIES

        parser = original_add_cli_args(parser)
        group = parser.add_argument_group(
            title="vllm-diffusion", description="Block-diffusion decoding (SDAR, LLaDA2).")
        group.add_argument(
            "--diffusion-policy", default=None, choices=sorted(POLICIES),
            help="Decoding policy for block-diffusion models; its options go in "
                 "--additional-config (e.g. --additional-config.threshold 0.8).")
        return parser

    def from_cli_args(cls, args):
        engine_args = original_from_cli_args(cls, args)
        policy = getattr(args, "diffusion_policy", None)
        if policy is not None:
            engine_args.additional_config = {
                **(engine_args.additional_config or {}), "diffusion_policy": policy}
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)


def _diffusion_config(processor: Any):
    """The processor's resolved diffusion configuration, or None for other models."""
    cached = getattr(processor, "_vllm_diffusion_config", _INSTALLED_FLAG)
    if cached is not _INSTALLED_FLAG:
        return cached
    from vllm_diffusion import ARCHITECTURES
    from vllm_diffusion.config import engine_config_from_vllm

    config = None
    if processor.model_config.architecture in ARCHITECTURES:
        config = engine_config_from_vllm(processor.vllm_config)
    processor._vllm_diffusion_config = config
    return config


def _install_request_validation() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_diffusion.requests import validate_prompt_ids, validate_sampling_params

    if getattr(InputProcessor, _INSTALLED_FLAG, False):
        return
    setattr(InputProcessor, _INSTALLED_FLAG, True)
    original_validate_params = InputProcessor._validate_params
    original_validate_model_input = InputProcessor._validate_model_input

    def _validate_params(self, params, supported_tasks):
        result = original_validate_params(self, params, supported_tasks)
        config = _diffusion_config(self)
        if config is not None and isinstance(params, SamplingParams):
            validate_sampling_params(params, config)
        return result

    def _validate_model_input(self, prompt_input, prompt_type):
        original_validate_model_input(self, prompt_input, prompt_type)
        config = _diffusion_config(self)
        if config is not None and prompt_input.get("type") != "embeds":
            validate_prompt_ids(prompt_input.get("prompt_token_ids"), config)

    InputProcessor._validate_params = _validate_params
    InputProcessor._validate_model_input = _validate_model_input


def _serves_diffusion_model(vllm_config: Any) -> bool:
    from vllm_diffusion import ARCHITECTURES

    model_config = getattr(vllm_config, "model_config", None)
    return model_config is not None and model_config.architecture in ARCHITECTURES


def _install_diffusion_metric_names() -> None:
    from vllm.v1.metrics import loggers
    from vllm.v1.metrics.utils import create_metric_per_engine
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    if getattr(loggers.LoggingStatLogger, _INSTALLED_FLAG, False):
        return
    setattr(loggers.LoggingStatLogger, _INSTALLED_FLAG, True)
    logging_init = loggers.LoggingStatLogger.__init__
    prometheus_init = loggers.PrometheusStatLogger.__init__

    def logging_stat_logger_init(self, vllm_config, *args, **kwargs):
        logging_init(self, vllm_config, *args, **kwargs)
        if _serves_diffusion_model(vllm_config):
            self.spec_decoding_logging = SpecDecodingLogging(is_diffusion=True)

    def prometheus_stat_logger_init(self, vllm_config, *args, **kwargs):
        prometheus_init(self, vllm_config, *args, **kwargs)
        if _serves_diffusion_model(vllm_config):
            # vLLM 0.32 labels every per-engine metric with ["model_name", "engine"].
            labelnames = ["model_name", "engine"]
            prom = self._spec_decoding_cls(None, labelnames, self.per_engine_labelvalues,
                                           is_diffusion=True)
            later_layers = create_metric_per_engine(
                prom._counter_cls(
                    name="vllm:diffusion_num_positions_after_eviction",
                    documentation="Block positions computed by the layers after the "
                                  "policy's eviction point (layers 2+; equal to the canvas "
                                  "positions when nothing is evicted).",
                    labelnames=labelnames),
                self.per_engine_labelvalues)
            per_layer = prom._counter_cls(
                name="vllm:diffusion_num_layer_positions",
                documentation="Block positions whose queries each layer computed (label "
                              "'layer'); lower in later layers when a policy drops rows.",
                labelnames=[*labelnames, "layer"])
            engine_labels = self.per_engine_labelvalues
            observe = prom.observe

            def observe_with_later_layers(stats, engine_idx: int = 0):
                observe(stats, engine_idx)
                counts = stats.num_draft_tokens_per_pos
                if counts:
                    later_layers[engine_idx].inc(counts[0])
                for layer, count in enumerate(counts[1:]):
                    per_layer.labels(*engine_labels[engine_idx], str(layer)).inc(count)

            prom.observe = observe_with_later_layers
            self.spec_decoding_prom = prom

    loggers.LoggingStatLogger.__init__ = logging_stat_logger_init
    loggers.PrometheusStatLogger.__init__ = prometheus_stat_logger_init


def _install_step_map_trimming() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_diffusion.config import STEP_MAP_KEY

    if getattr(OutputProcessor, _INSTALLED_FLAG, False):
        return
    setattr(OutputProcessor, _INSTALLED_FLAG, True)
    trim_surplus_tokens = OutputProcessor._trim_surplus_tokens

    def trim_surplus_tokens_and_step_map(req_state, output, num_prev_tokens):
        trim_surplus_tokens(req_state, output, num_prev_tokens)
        params = output.kv_transfer_params
        if params and STEP_MAP_KEY in params:
            num_tokens = req_state.detokenizer.num_output_tokens()
            params[STEP_MAP_KEY] = params[STEP_MAP_KEY][:num_tokens]

    OutputProcessor._trim_surplus_tokens = staticmethod(trim_surplus_tokens_and_step_map)


def _install_offline_recovery() -> None:
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    if getattr(OfflineInferenceMixin, _INSTALLED_FLAG, False):
        return
    setattr(OfflineInferenceMixin, _INSTALLED_FLAG, True)
    run_engine = OfflineInferenceMixin._run_engine

    def run_engine_and_abort_on_failure(self, *args, **kwargs):
        try:
            return run_engine(self, *args, **kwargs)
        except BaseException:
            engine = self.llm_engine
            if _serves_diffusion_model(engine.vllm_config):
                unfinished = list(engine.output_processor.request_states)
                if unfinished:
                    engine.abort_request(unfinished, internal=True)
            raise

    OfflineInferenceMixin._run_engine = run_engine_and_abort_on_failure


def _install_shutdown_notice() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    if getattr(AsyncLLM, _INSTALLED_FLAG, False):
        return
    setattr(AsyncLLM, _INSTALLED_FLAG, True)
    shutdown = AsyncLLM.shutdown

    def fail_in_flight_requests(engine) -> None:
        # On the event loop's thread: the request queues are asyncio objects.
        if engine.output_processor.request_states:
            engine.output_processor.propagate_error(EngineDeadError(
                "the server is shutting down; the request was not finished"))

    def shutdown_and_end_in_flight_requests(self, *args, **kwargs):
        handler = getattr(self, "output_handler", None)
        shutdown(self, *args, **kwargs)
        if handler is None or not _serves_diffusion_model(self.vllm_config):
            return
        loop = handler.get_loop()
        if not loop.is_closed():
            loop.call_soon_threadsafe(fail_in_flight_requests, self)

    AsyncLLM.shutdown = shutdown_and_end_in_flight_requests
