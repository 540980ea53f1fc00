"""The converted default model: SmolLM2-135M-Instruct merged with the repository's adapter
(``checkpoints/smollm2-dllm``) into a Fast-dLLM v2 checkpoint (``Fast_dLLM_Qwen``: Qwen2's
layers, whose q/k/v biases are zero here, equal Llama's) in the cache, checked by hash.

The adapter directory holds ``adapter.safetensors`` (LoRA factors in int8 with a float32
scale per row, ``stored_adapter``; norm weights and the mask row in float32) and
``conversion.json`` (rank, alpha, block size, mask token, the decoding defaults written
into ``config.json`` as ``diffusion_option_defaults``, and the SHA-256 of the merged
weights). The merge runs in
float64 and rounds once to float32, so that it gives the same bits on every machine.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

import torch

from vllm_diffusion.default_model import REPOSITORY_CHECKPOINTS, converted_model_dir
from vllm_diffusion_lab.real_model.conversion import MASK_TOKEN_ID, merged_weights
from vllm_diffusion_lab.real_model.original import build_original, original_checkpoint

ADAPTER_DIR = REPOSITORY_CHECKPOINTS / "smollm2-dllm"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def converted_checkpoint() -> pathlib.Path:
    return converted_model_dir()


def stored_adapter(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter as the repository stores it: each LoRA factor's rows in int8 scaled by
    their largest magnitude (``{name}`` int8 and ``scale.{name}`` float32 [rows, 1]), the
    rest in float32."""
    stored = {}
    for key, value in adapter.items():
        value = value.float()
        if key.startswith("lora"):
            scale = value.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            stored[key] = (value / scale).round().clamp(-127, 127).to(torch.int8)
            stored[f"scale.{key}"] = scale
        else:
            stored[key] = value
    return {k: v.contiguous() for k, v in stored.items()}


def loaded_adapter(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``stored_adapter``'s inverse (the int8 factors times their scales, float32)."""
    return {key: value.float() * stored[f"scale.{key}"] if value.dtype == torch.int8
            else value.float()
            for key, value in stored.items() if not key.startswith("scale.")}


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def converted_config(original: dict, conversion: dict) -> dict:
    """Fast-dLLM v2's config.json for SmolLM2's shape."""
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
            "vocab_size", "tie_word_embeddings", "hidden_act", "bos_token_id",
            "eos_token_id", "pad_token_id", "initializer_range")
    config = {k: original[k] for k in keep if k in original}
    config.update({
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
        "rope_theta": original["rope_parameters"]["rope_theta"], "torch_dtype": "float32",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0,
        "bd_size": conversion["block_size"], "mask_token_id": MASK_TOKEN_ID,
        "diffusion_option_defaults": conversion["decoding_defaults"], "use_cache": True,
    })
    return config


def build_converted(out: pathlib.Path | None = None, adapter_dir: pathlib.Path = ADAPTER_DIR,
                    force: bool = False) -> pathlib.Path:
    """Merge the adapter into the original (built first if missing) and write the
    converted checkpoint; raises if the merged weights' hash is not the recorded one."""
    from safetensors.torch import load_file, save_file

    out = pathlib.Path(out or converted_checkpoint())
    conversion = json.loads((adapter_dir / "conversion.json").read_text())
    stamp = out / "conversion.json"
    if (out / "model.safetensors").is_file() and stamp.is_file() and not force \
            and json.loads(stamp.read_text()) == conversion:
        return out
    original = build_original(original_checkpoint())
    base = load_file(original / "model.safetensors")
    adapter = loaded_adapter(load_file(adapter_dir / "adapter.safetensors"))
    merged = merged_weights(base, adapter, conversion["alpha"] / conversion["rank"])
    for i in range(json.loads((original / "config.json").read_text())["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = merged[f"model.layers.{i}.self_attn.{proj}.weight"]
            merged[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(weight.shape[0])
    digest = weights_digest(merged)
    if conversion.get("sha256") and digest != conversion["sha256"]:
        raise RuntimeError(f"the merged weights' SHA-256 {digest} is not the recorded "
                           f"{conversion['sha256']} ({adapter_dir / 'conversion.json'})")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(merged, tmp / "model.safetensors", metadata={"format": "pt"})
    config = converted_config(json.loads((original / "config.json").read_text()), conversion)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = json.loads((original / "generation_config.json").read_text())
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in COPIED_FILES:
        shutil.copy(original / name, tmp / name)
    (tmp / "conversion.json").write_text(json.dumps(conversion))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
