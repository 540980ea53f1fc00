"""Builds a full-attention family's vLLM model class (``LLaDAModelLM``, ``DreamModel``) for a
checkpoint on CPU outside an engine, loads its weights and runs one forward; run as a script
(``test_full_attention_models`` starts it in a fresh process: it initialises vLLM's
distributed state, which an in-process engine test would then find).

    python full_attention_loading.py CHECKPOINT_DIR [CHECKPOINT_DIR ...]

prints one JSON line per checkpoint: ``architecture``, ``unloaded`` (parameters no
checkpoint weight reached), ``unknown`` (loaded names that are no parameter), ``token_ids``
and ``logits`` ([L, vocab], the model's per-row logits for those ids at positions 0..L-1).

Only the model class is built: the plugin's start-up hook (its refusals, options, scheduler
and worker) is bypassed, and every layer's attention is replaced by ``PlainFullAttention``
(one sequence, every row attending to every row) for the forward, so that the check needs
neither the engine nor its attention backend.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class PlainFullAttention(nn.Module):
    """Stands in for a layer's ``attn``: q [T, H * D], k/v [T, H_kv * D] of one sequence ->
    [T, H * D], no mask."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows = q.shape[0]
        q = q.view(rows, self.heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        k = k.view(rows, self.kv_heads, self.head_dim).transpose(0, 1)  # [H_kv, T, D]
        v = v.view(rows, self.kv_heads, self.head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # [H, T, D]
        return out.transpose(0, 1).reshape(rows, -1)


def vllm_config_for(checkpoint: pathlib.Path):
    """vLLM's configuration of ``checkpoint`` (float32, eager), without the plugin's
    start-up hook."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    architecture = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    hook = MODELS_CONFIG_MAP.pop(architecture, None)
    try:
        return EngineArgs(model=str(checkpoint), dtype="float32", enforce_eager=True,
                          max_model_len=256).create_engine_config()
    finally:
        if hook is not None:
            MODELS_CONFIG_MAP[architecture] = hook


def load_and_run(checkpoint: pathlib.Path, token_ids: list[int]) -> dict:
    from safetensors.torch import load_file

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import (initialize_model,
                                                        process_weights_after_loading)

    vllm_config = vllm_config_for(checkpoint)
    with set_current_vllm_config(vllm_config):
        init_world_of_one()
        with torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        loaded = model.load_weights(load_file(str(checkpoint / "model.safetensors")).items())
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        parameters = {name for name, _ in model.named_parameters()}
        for layer in model.model.layers:
            layer.self_attn.attn = PlainFullAttention(layer.self_attn)
        ids = torch.tensor(token_ids)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, torch.arange(len(token_ids))))
    return {"architecture": type(model).__name__, "unloaded": sorted(parameters - loaded),
            "unknown": sorted(loaded - parameters), "token_ids": token_ids,
            "logits": logits.tolist()}


def init_world_of_one() -> None:
    """vLLM's distributed state for one CPU rank (gloo), as its CPU worker sets it up; once
    per process, under a current vLLM config."""
    from vllm.distributed import (init_distributed_environment, initialize_model_parallel,
                                  model_parallel_is_initialized)
    from vllm.utils.network_utils import get_open_port

    if model_parallel_is_initialized():
        return
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    initialize_model_parallel(1, 1)


def main(checkpoints: list[str]) -> None:
    import vllm_diffusion

    vllm_diffusion.register()
    for checkpoint in checkpoints:
        token_ids = list(range(5, 45, 2))  # 20 ordinary ids of the tiny tokenizer
        print(json.dumps(load_and_run(pathlib.Path(checkpoint), token_ids)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
