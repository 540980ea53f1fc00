"""Pins the vLLM 0.32 symbols vllm-diffusion wraps, subclasses or calls into (see
patches/README.md): their parameter names, and the fields of the output types it extends.
A vLLM upgrade that changes any of them fails here, in CI, instead of at run time.

Read in a fresh interpreter: the plugin's wrappers replace some of these attributes once
an engine has started in this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PARAMETERS = {
    "vllm.engine.arg_utils:EngineArgs.add_cli_args": ('parser',),
    "vllm.engine.arg_utils:EngineArgs.from_cli_args": ('args',),
    "vllm.v1.engine.input_processor:InputProcessor._validate_params": ('self', 'params', 'supported_tasks'),
    "vllm.v1.engine.input_processor:InputProcessor._validate_model_input": ('self', 'prompt_input', 'prompt_type'),
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs": ('self', 'request_id', 'prompt', 'params', 'supported_tasks', 'arrival_time', 'lora_request', 'tokenization_kwargs', 'trace_headers', 'priority', 'data_parallel_rank', 'resumable', 'session_id', 'kv_hints'),
    "vllm.v1.engine.output_processor:OutputProcessor.process_outputs": ('self', 'engine_core_outputs', 'engine_core_timestamp', 'iteration_stats', 'weight_version'),
    "vllm.v1.metrics.loggers:LoggingStatLogger.__init__": ('self', 'vllm_config', 'engine_index'),
    "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__": ('self', 'vllm_config', 'engine_indexes'),
    "vllm.v1.engine.output_processor:OutputProcessor._trim_surplus_tokens": ('req_state', 'output', 'num_prev_tokens'),
    "vllm.v1.engine.output_processor:OutputProcessor.propagate_error": ('self', 'e'),
    "vllm.entrypoints.common.offline:OfflineInferenceMixin._run_engine": ('self', 'output_type', 'use_tqdm'),
    "vllm.v1.engine.async_llm:AsyncLLM.shutdown": ('self', 'timeout'),
    "vllm.v1.engine.async_llm:AsyncLLM.add_request": ('self', 'request_id', 'prompt', 'params', 'arrival_time', 'lora_request', 'tokenization_kwargs', 'trace_headers', 'priority', 'data_parallel_rank', 'session_id', 'prompt_text', 'reasoning_ended', 'reasoning_parser_kwargs', 'kv_hints'),
    "vllm.renderers.base:BaseRenderer.render_chat_async": ('self', 'conversations', 'chat_params', 'tok_params', 'prompt_extras', 'skip_mm_cache'),
    "vllm.renderers.base:BaseRenderer.render_cmpl_async": ('self', 'prompts', 'tok_params', 'prompt_extras', 'skip_mm_cache'),
    "vllm.v1.engine.llm_engine:LLMEngine.abort_request": ('self', 'request_ids', 'internal'),
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion": ('self', 'request', 'raw_request'),
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion": ('self', 'request', 'raw_request'),
    "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.create_responses": ('self', 'request', 'raw_request'),
    "vllm.entrypoints.serve.engine.serving:BaseServing.create_error_response": ('message', 'err_type', 'status_code', 'param'),
    "vllm.v1.core.sched.scheduler:Scheduler.__init__": ('self', 'vllm_config', 'kv_cache_config', 'structured_output_manager', 'block_size', 'hash_block_size', 'mm_registry', 'include_finished_set', 'log_stats'),
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ('self', 'throttle_prefills'),
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ('self', 'scheduler_output', 'model_runner_output'),
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests": ('self', 'request_ids', 'finished_status'),
    "vllm.v1.core.sched.scheduler:Scheduler.make_stats": ('self', 'spec_decoding_stats', 'kv_connector_stats', 'cudagraph_stats', 'perf_stats', 'ec_connector_stats'),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": ('self', 'scheduler_output', 'intermediate_tensors'),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": ('self', 'scheduler_output'),
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": ('self',),
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__": ('self', 'vllm_config', 'device'),
    "vllm.v1.spec_decode.metrics:SpecDecodingStats.__init__": ('self', 'num_spec_tokens', 'num_drafts', 'num_draft_tokens', 'num_accepted_tokens', 'num_accepted_tokens_per_pos', 'num_draft_tokens_per_pos'),
    "vllm.v1.spec_decode.metrics:SpecDecodingLogging.__init__": ('self', 'is_diffusion'),
    "vllm.v1.spec_decode.metrics:SpecDecodingProm.__init__": ('self', 'speculative_config', 'labelnames', 'per_engine_labelvalues', 'is_diffusion'),
    "vllm.v1.spec_decode.metrics:SpecDecodingProm.observe": ('self', 'spec_decoding_stats', 'engine_idx'),
    "vllm.v1.metrics.utils:create_metric_per_engine": ('metric', 'per_engine_labelvalues'),
    "vllm.v1.metrics.loggers:load_stat_logger_plugin_factories": (),
    "vllm.model_executor.models.utils:AutoWeightsLoader.__init__": ('self', 'module', 'ignore_unexpected_prefixes', 'ignore_unexpected_suffixes'),
    "vllm.model_executor.models.utils:AutoWeightsLoader.load_weights": ('self', 'weights', 'mapper'),
    "vllm.forward_context:set_forward_context": ('attn_metadata', 'vllm_config', 'num_tokens', 'num_tokens_across_dp', 'cudagraph_runtime_mode', 'batch_descriptor', 'ubatch_slices', 'slot_mapping', 'skip_compiled', 'is_padding'),
    "vllm.model_executor.models.qwen3:Qwen3Model.__init__": ('self', 'args', 'vllm_config', 'prefix', 'kwargs'),
    "vllm.model_executor.models.qwen2:Qwen2Model.__init__": ('self', 'args', 'vllm_config', 'prefix', 'kwargs'),
    "vllm.model_executor.models.qwen3_moe:Qwen3MoeModel.__init__": ('self', 'args', 'vllm_config', 'prefix', 'kwargs'),
    "vllm.model_executor.models.qwen3_moe:Qwen3MoeSparseMoeBlock.__init__": ('self', 'vllm_config', 'prefix', 'is_fused_checkpoint_transposed'),
    "vllm.model_executor.models.qwen2:Qwen2MLP.__init__": ('self', 'hidden_size', 'intermediate_size', 'hidden_act', 'quant_config', 'prefix'),
    "vllm.model_executor.layers.attention:Attention.forward": ('self', 'query', 'key', 'value', 'output_shape', 'output_dtype'),
    "vllm.model_executor.layers.rotary_embedding:get_rope": ('head_size', 'max_position', 'is_neox_style', 'rope_parameters', 'dtype', 'dual_chunk_attention_config', 'mrope_positions_factor'),
    "vllm.model_executor.layers.linear:QKVParallelLinear.__init__": ('self', 'hidden_size', 'head_size', 'total_num_heads', 'total_num_kv_heads', 'bias', 'skip_bias_add', 'params_dtype', 'quant_config', 'prefix', 'return_bias', 'disable_tp', 'v_head_size'),
    "vllm.model_executor.layers.linear:RowParallelLinear.__init__": ('self', 'input_size', 'output_size', 'bias', 'input_is_parallel', 'skip_bias_add', 'params_dtype', 'reduce_results', 'quant_config', 'prefix', 'return_bias', 'disable_tp'),
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.__init__": ('self', 'num_embeddings', 'embedding_dim', 'bias', 'params_dtype', 'org_num_embeddings', 'padding_size', 'quant_config', 'prefix', 'disable_tp'),
    "vllm.transformers_utils.config:set_default_rope_theta": ('config', 'default_theta'),
    "vllm.model_executor.models.utils:extract_layer_index": ('layer_name', 'num_attn_module'),
    "vllm.config:get_current_vllm_config": (),
    "vllm.model_executor.layers.attention:Attention.__init__": ('self', 'num_heads', 'head_size', 'scale', 'num_kv_heads', 'alibi_slopes', 'use_alibi_sqrt', 'cache_config', 'quant_config', 'logits_soft_cap', 'per_layer_sliding_window', 'prefix', 'attn_type', 'kv_sharing_target_layer_name', 'mm_prefix_clamp_sliding_window', 'attn_backend', 'head_size_v', 'extra_impl_args'),
    "vllm._custom_ops:cpu_attention_with_kv_cache": ('query', 'key_cache', 'value_cache', 'output', 'query_start_loc', 'seq_lens', 'scale', 'causal', 'alibi_slopes', 'sliding_window', 'block_table', 'softcap', 'scheduler_metadata', 's_aux', 'dynamic_causal', 'k_scale', 'v_scale', 'kv_cache_dtype'),
    "vllm._custom_ops:cpu_attn_get_scheduler_metadata": ('num_reqs', 'num_heads', 'num_kv_heads', 'head_dim', 'seq_lens', 'dtype', 'query_start_loc', 'causal', 'sliding_window_size', 'isa', 'enable_kv_split', 'dynamic_causal', 'kv_cache_dtype'),
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_head_sizes": (),
}
# Output types whose fields the project reads, fills or extends.
FIELDS = {
    "vllm.v1.outputs:ModelRunnerOutput": ("req_ids", "req_id_to_index", "sampled_token_ids"),
    "vllm.v1.engine:EngineCoreOutput": ("request_id", "new_token_ids", "finish_reason",
                                        "events", "trace_headers", "kv_transfer_params"),
    "vllm.v1.engine:EngineCoreOutputs": ("outputs",),
    "vllm.forward_context:ForwardContext": ("attn_metadata",),
    # compact JSON: the config hook sets disable_any_whitespace (compact_json.py)
    "vllm.config.structured_outputs:StructuredOutputsConfig": ("backend",
                                                               "disable_any_whitespace"),
    # a grammar the core could not compile: its exception (worker/scheduler.py)
    "vllm.v1.structured_output.request:StructuredOutputRequest": ("params", "_grammar"),
}

_PROBE = r"""
import dataclasses, importlib, inspect, json, sys
def resolve(symbol):
    module, qualified = symbol.split(":")
    obj = importlib.import_module(module)
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return obj
request = json.loads(sys.stdin.read())
out = {"parameters": {}, "fields": {}}
for symbol in request["parameters"]:
    out["parameters"][symbol] = list(inspect.signature(resolve(symbol)).parameters)
for symbol in request["fields"]:
    cls = resolve(symbol)
    names = (cls.__struct_fields__ if hasattr(cls, "__struct_fields__")
             else [f.name for f in dataclasses.fields(cls)])
    out["fields"][symbol] = list(names)
print("PINNED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def upstream() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], input=json.dumps(
            {"parameters": list(PARAMETERS), "fields": list(FIELDS)}),
        capture_output=True, text=True, timeout=300, check=True)
    line = next(x for x in result.stdout.splitlines() if x.startswith("PINNED "))
    return json.loads(line[len("PINNED "):])


@pytest.mark.parametrize("symbol", list(PARAMETERS))
def test_wrapped_vllm_signature_is_unchanged(upstream, symbol):
    assert tuple(upstream["parameters"][symbol]) == PARAMETERS[symbol], (
        f"{symbol} changed in this vLLM: revisit the deviation that uses it "
        f"(patches/README.md)")


@pytest.mark.parametrize("symbol", list(FIELDS))
def test_extended_vllm_output_type_keeps_its_fields(upstream, symbol):
    missing = set(FIELDS[symbol]) - set(upstream["fields"][symbol])
    assert not missing, f"{symbol} lost {sorted(missing)}"


def test_the_scheduler_still_collects_the_grammars_it_could_not_compile():
    """``worker/scheduler.py`` answers the requests vLLM's scheduler collects in
    ``grammar_compile_error_reqs`` (set where a request waiting for its grammar is
    promoted, emptied in ``update_from_output``) with a 400 naming the grammar."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    for method in (Scheduler.__init__, Scheduler._handle_blocked_waiting_request,
                   Scheduler.update_from_output):
        assert "self.grammar_compile_error_reqs" in inspect.getsource(method), method
