"""Start-up configuration of vLLM for a block-diffusion checkpoint: ``DiffusionModelConfigHook``
(vLLM's ``MODELS_CONFIG_MAP``, for the plugin's architectures) resolves and validates the
diffusion options, stores them in ``additional_config``, selects the diffusion scheduler
and worker, and makes JSON grammars compact.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from vllm_diffusion.capabilities import ModelCapabilities, model_refusal, refusal
from vllm_diffusion.compact_json import apply_json_layout
from vllm_diffusion.config import ROLLBACK_BACKENDS, parse_engine_options, store_resolved
from vllm_diffusion.models.configs import model_capabilities
from vllm_diffusion.policies import POLICIES

logger = init_logger(__name__)

SCHEDULER_CLS = "vllm_diffusion.worker.scheduler.BlockDiffusionScheduler"
CPU_WORKER_CLS = "vllm_diffusion.worker.cpu_worker.DiffusionCPUWorker"
GPU_WORKER_CLS = "vllm_diffusion.worker.gpu_worker.DiffusionGPUWorker"
CPU_KV_CACHE_BYTES = 1 << 30  # when none is given on CPU
# Full attention: the step budget raised to at most this many rows by default (a larger
# --max-num-batched-tokens batches more whole sequences per step)
FULL_ATTENTION_BATCHED_TOKENS = 16384

# The mask token's text in checkpoints whose tokenizer does not name a mask_token.
MASK_TOKEN_TEXTS = ("<|mask|>",)


def _tokenizer_mask_token_id(model_config: Any) -> int | None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code)
    except Exception:  # noqa: BLE001 - a missing tokenizer is reported as "no mask token"
        return None
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    vocab = tokenizer.get_vocab()
    return next((vocab[text] for text in MASK_TOKEN_TEXTS if text in vocab), None)


def refuse_combination(model: ModelCapabilities, engine_options: dict[str, Any],
                       config: Any = None) -> None:
    """Raise ``ValueError`` where the chosen policy cannot serve the model
    (``capabilities.refusal``): with the options as given (so that the reason is the
    model's, not its option defaults'), then, given ``config``, with the resolved ones."""
    policy = POLICIES.get(engine_options.get("diffusion_policy", "standard"))
    if policy is None:
        return  # parsing the options names the unknown policy
    given = {k: v for k, v in engine_options.items() if k != "diffusion_policy"}
    cache_mode = engine_options.get("diffusion_cache_mode", "recompute")
    reason = refusal(model, policy, given, cache_mode=cache_mode)
    if reason is None and config is not None:
        reason = refusal(model, policy, dataclasses.asdict(config.policy_config), given,
                         block_size=config.block_size, cache_mode=config.cache_mode)
    if reason is not None:
        raise ValueError(reason)


class DiffusionModelConfigHook(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        from vllm.platforms import current_platform

        from vllm_diffusion.seams.log_filters import install_client_error_filters

        install_client_error_filters()  # this process serves one of the plugin's models
        model_config = vllm_config.model_config
        hf_config = model_config.hf_config
        mask_token_id = getattr(hf_config, "mask_token_id", None)
        if mask_token_id is None:
            mask_token_id = _tokenizer_mask_token_id(model_config)
        model = model_capabilities(hf_config)
        unserved = model_refusal(model)
        if unserved is not None:
            raise ValueError(unserved)
        extra = dict(vllm_config.additional_config or {})
        refuse_combination(model, extra)
        config = parse_engine_options(
            extra, config_block_size=getattr(hf_config, "block_size", None),
            config_mask_token_id=mask_token_id, vocab_size=model_config.get_vocab_size(),
            model=model)
        refuse_combination(model, extra, config)
        store_resolved(vllm_config, config)

        block = config.block_size
        full_attention = model.attention == "full"
        if full_attention and vllm_config.cache_config.enable_prefix_caching:
            logger.info("vllm-diffusion: prefix caching disabled: %s attends over the whole "
                        "sequence, so a prompt's KV depends on the canvas after it",
                        model.family)
            vllm_config.cache_config.enable_prefix_caching = False
        if not full_attention and model_config.max_model_len % block:
            raise ValueError(
                f"max_model_len ({model_config.max_model_len}) must be a multiple of the "
                f"diffusion block size ({block}); use --max-model-len "
                f"{model_config.max_model_len // block * block}")
        policy = config.make_policy()
        policy.bind(model, hf_config, bool(vllm_config.cache_config.enable_prefix_caching))
        if vllm_config.speculative_config is not None:
            raise ValueError("speculative decoding cannot be combined with block diffusion")
        structured = vllm_config.structured_outputs_config
        if structured is not None and structured.backend not in ("auto", *ROLLBACK_BACKENDS):
            raise ValueError(
                f"structured outputs backend {structured.backend!r} cannot roll back a "
                "matcher, which block decoding needs to check a block's proposals; use "
                f"one of auto, {', '.join(ROLLBACK_BACKENDS)}")
        if structured is not None:
            apply_json_layout(structured, config.json_any_whitespace)

        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", "false", "False"):
            raise ValueError(
                "vllm-diffusion runs on the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
        # vLLM selects the runner by the environment only (patches/README.md row 16).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

        cache_config = vllm_config.cache_config
        if (current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                and cache_config.kv_cache_memory_bytes is None):
            logger.info("vllm-diffusion: no CPU KV-cache size given (VLLM_CPU_KVCACHE_SPACE, "
                        "--kv-cache-memory-bytes); using %d bytes (1 GiB)", CPU_KV_CACHE_BYTES)
            cache_config.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES

        parallel_config = vllm_config.parallel_config
        worker_cls = CPU_WORKER_CLS if current_platform.is_cpu() else GPU_WORKER_CLS
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = worker_cls
        elif parallel_config.worker_cls != worker_cls:
            raise ValueError(
                f"--worker-cls {parallel_config.worker_cls} cannot serve a block-diffusion "
                f"model; leave it unset (vllm-diffusion selects {worker_cls})")

        scheduler_config = vllm_config.scheduler_config
        if scheduler_config.scheduler_cls not in (None, SCHEDULER_CLS):
            raise ValueError(
                f"--scheduler-cls {scheduler_config.scheduler_cls} cannot serve a "
                f"block-diffusion model; leave it unset")
        scheduler_config.scheduler_cls = SCHEDULER_CLS
        scheduler_config.async_scheduling = False
        if full_attention:
            # A step computes each running request's whole sequence (at most max_model_len
            # rows); requests past the step's budget wait for a later step.
            needed = max(model_config.max_model_len, min(
                FULL_ATTENTION_BATCHED_TOKENS,
                model_config.max_model_len * scheduler_config.max_num_seqs))
            why = "full attention: whole sequences of max_num_seqs requests, up to %d" % (
                FULL_ATTENTION_BATCHED_TOKENS)
        else:
            # A step commits one block and denoises the next for every running request.
            needed = 2 * block * scheduler_config.max_num_seqs
            why = "2 * diffusion block size * max_num_seqs"
        if scheduler_config.max_num_batched_tokens < needed:
            logger.info("vllm-diffusion: raising max_num_batched_tokens from %d to %d (%s)",
                        scheduler_config.max_num_batched_tokens, needed, why)
            scheduler_config.max_num_batched_tokens = needed
        if (scheduler_config.max_num_scheduled_tokens or needed) < needed:
            scheduler_config.max_num_scheduled_tokens = needed

        logger.info("vllm-diffusion: policy %s, diffusion block size %d, mask token %d, %s",
                    config.policy_name, block, config.mask_token_id,
                    "JSON with any whitespace" if config.json_any_whitespace
                    else "compact JSON (diffusion_json_any_whitespace allows whitespace)")
