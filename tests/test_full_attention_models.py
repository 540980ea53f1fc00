"""The full-attention families, LLaDA 1.x and Dream, without an engine: the plain references
against independent code of the same published models, their decoding loops' published
rules, the vLLM model classes (every weight of a tiny checkpoint loaded; logits equal the
reference's with a plain full attention in place of the engine's), and the configurations
and capability declarations."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from reference_dream import ReferenceDream, confidences, transfer_count
from reference_dream import reference_generate as dream_generate
from reference_llada import ReferenceLLaDA, get_num_transfer_tokens
from reference_llada import reference_generate as llada_generate
from safetensors.torch import load_file

from vllm_diffusion_lab.fixtures.tiny_dream import build_tiny_dream
from vllm_diffusion_lab.fixtures.tiny_llada import build_tiny_llada
from vllm_diffusion_lab.training import llada_format

TESTS = pathlib.Path(__file__).resolve().parent
PROMPTS = ([10, 11, 12, 13, 14, 15, 16], [40, 7, 300, 12, 9], [200, 201, 5, 6, 7, 8, 9, 10, 11])


@pytest.fixture(scope="module")
def llada_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llada(tmp_path_factory.mktemp("llada"), embedding_size=576)


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_dream(tmp_path_factory.mktemp("dream"), vocab_size=600)


def config_of(checkpoint: pathlib.Path) -> dict:
    return json.loads((checkpoint / "config.json").read_text())


def lab_model(checkpoint: pathlib.Path) -> llada_format.LLaDAModelLM:
    model = llada_format.LLaDAModelLM(config_of(checkpoint)).eval()
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
    return model


# ------------------------------------------------------------------------------- LLaDA
def test_llada_reference_forward_equals_the_lab_model(llada_checkpoint):
    ids = torch.tensor([3] * 6 + list(range(20, 60, 3)) + [3] * 4)  # masks around text
    reference = ReferenceLLaDA(llada_checkpoint)(ids)
    with torch.no_grad():
        lab = lab_model(llada_checkpoint)(ids[None])[0]
    assert reference.shape == (len(ids), 576)  # embedding_size rows, past the tokenizer
    torch.testing.assert_close(reference, lab, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("gen_length,block_length,steps", [
    (16, 8, 16),  # one token per step, two blocks
    (16, 8, 6),  # three steps per block: quotas 3, 3, 2
    (12, 12, 5),  # one block, quotas 3, 3, 2, 2, 2
    (8, 4, 12),  # more steps than masks: steps with quota 0 commit nothing
])
def test_llada_reference_loop_equals_the_lab_loop(llada_checkpoint, gen_length, block_length,
                                                   steps):
    reference, lab = ReferenceLLaDA(llada_checkpoint), lab_model(llada_checkpoint)
    mask_id = config_of(llada_checkpoint)["mask_token_id"]
    for prompt in PROMPTS:
        ours = llada_generate(reference, prompt, mask_id=mask_id, gen_length=gen_length,
                              block_length=block_length, steps=steps)
        assert ours == llada_format.generate(lab, prompt, mask_id=mask_id,
                                             gen_length=gen_length,
                                             block_length=block_length, steps=steps)
        assert len(ours) == gen_length and mask_id not in ours


def test_llada_quota_schedule():
    assert get_num_transfer_tokens(8, 3) == [3, 3, 2]
    assert get_num_transfer_tokens(4, 6) == [1, 1, 1, 1, 0, 0]
    assert get_num_transfer_tokens(32, 32) == [1] * 32


def test_llada_eos_switches(llada_checkpoint):
    """``logits_eos_inf`` bars EOS from the argmax; without it the tiny model emits EOS
    (its EOS output row is scaled up)."""
    reference = ReferenceLLaDA(llada_checkpoint)
    config = config_of(llada_checkpoint)
    mask_id, eos = config["mask_token_id"], config["eos_token_id"]
    outputs = {barred: [llada_generate(reference, prompt, mask_id=mask_id, gen_length=16,
                                       block_length=8, steps=8, logits_eos_inf=barred,
                                       eos_id=eos, eot_id=eos)
                        for prompt in PROMPTS] for barred in (False, True)}
    assert any(eos in output for output in outputs[False])
    assert not any(eos in output for output in outputs[True])


# ------------------------------------------------------------------------------- Dream
def test_dream_transfer_counts_truncate_and_recount_the_masks():
    """Per step ``int(M * (1 - s / t))`` of the masks M still there, every one at the
    last: 10 masks over 4 steps (eps 1e-3) go 2, 2, 2, 4."""
    timesteps = torch.linspace(1, 1e-3, 5)
    remaining, counts = 10, []
    for step in range(4):
        counts.append(transfer_count(remaining, step, timesteps))
        remaining -= counts[-1]
    assert counts == [2, 2, 2, 4]
    # as many steps as masks: the first step's count truncates to 0
    assert transfer_count(16, 0, torch.linspace(1, 1e-3, 17)) == 0


def test_dream_confidence_algorithms():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.4, 0.1, 0.25, 0.25]])
    confidence, tokens = confidences(probs, "maskgit_plus")
    assert tokens[1] == 0 and confidence.argmax() == 0  # 0.5 > 0.4
    assert confidences(probs, "topk_margin")[0].argmax() == 1  # 0 < 0.4 - 0.25
    entropy = confidences(probs, "entropy")[0]  # negative entropy: the first is lower
    assert entropy[0] > entropy[1] and (entropy <= 0).all()


class ShiftProbe:
    """A stand-in model: row j predicts token 100 + j, more surely for lower j."""

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = len(token_ids)
        logits = torch.zeros(rows, 200)
        logits[torch.arange(rows), 100 + torch.arange(rows)] = 20.0 - 0.1 * torch.arange(rows)
        return logits


def test_dream_loop_reads_each_position_from_the_row_before():
    prompt = [1, 2, 3, 4, 5]
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        generated = dream_generate(ShiftProbe(), prompt, mask_id=0, max_new_tokens=6,
                                   steps=3, alg=alg)
        assert generated == [100 + j - 1 for j in range(5, 11)]


def test_dream_reference_loop_decodes_the_canvas(dream_checkpoint):
    reference = ReferenceDream(dream_checkpoint)
    mask_id = config_of(dream_checkpoint)["mask_token_id"]
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        generated = dream_generate(reference, PROMPTS[0], mask_id=mask_id, max_new_tokens=12,
                                   steps=5, alg=alg)
        assert len(generated) == 12 and mask_id not in generated


# ------------------------------------------------------------- the vLLM model classes
@pytest.fixture(scope="module")
def loaded_models(tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict]]:
    """Each tiny checkpoint, and what ``full_attention_loading`` reports for it (one fresh
    process for all)."""
    root = tmp_path_factory.mktemp("full-attention")
    checkpoints = {
        "llada": build_tiny_llada(root / "llada", embedding_size=576),
        "llada-tied": build_tiny_llada(root / "llada-tied", weight_tying=True, num_kv_heads=4),
        "dream": build_tiny_dream(root / "dream", vocab_size=600),
        "dream-tied": build_tiny_dream(root / "dream-tied", tie_word_embeddings=True),
    }
    done = subprocess.run([sys.executable, str(TESTS / "full_attention_loading.py"),
                           *map(str, checkpoints.values())], capture_output=True, text=True,
                          timeout=600, cwd=TESTS, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(checkpoints), done.stdout[-2000:]
    return {name: (checkpoint, report)
            for (name, checkpoint), report in zip(checkpoints.items(), reports)}


@pytest.mark.parametrize("name,architecture,reference", [
    ("llada", "LLaDAModelLM", ReferenceLLaDA), ("llada-tied", "LLaDAModelLM", ReferenceLLaDA),
    ("dream", "DreamModel", ReferenceDream), ("dream-tied", "DreamModel", ReferenceDream)])
def test_vllm_model_loads_every_weight_and_matches_the_reference(loaded_models, name,
                                                                architecture, reference):
    checkpoint, report = loaded_models[name]
    assert report["architecture"] == architecture
    assert report["unloaded"] == [] and report["unknown"] == []
    expected = reference(checkpoint)(torch.tensor(report["token_ids"]))
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------- configs, capabilities
def test_configs_round_trip_and_declare_full_attention(llada_checkpoint, dream_checkpoint):
    from transformers import AutoConfig

    from vllm_diffusion.models.configs import model_capabilities, register_hf_configs
    from vllm_diffusion.models.full_attention_configs import DreamConfig, LLaDAConfig

    register_hf_configs()
    llada = AutoConfig.from_pretrained(llada_checkpoint)
    published = config_of(llada_checkpoint)
    assert isinstance(llada, LLaDAConfig)
    assert (llada.hidden_size, llada.num_attention_heads, llada.num_key_value_heads,
            llada.num_hidden_layers, llada.intermediate_size, llada.head_dim) == (
        published["d_model"], published["n_heads"], published["n_kv_heads"],
        published["n_layers"], published["mlp_hidden_size"], 16)
    assert (llada.vocab_size, llada.text_vocab_size) == (576, published["vocab_size"])
    assert llada.mask_token_id == published["mask_token_id"]
    assert llada.max_position_embeddings == published["max_sequence_length"]
    assert llada.tie_word_embeddings is False and llada.unserved_settings() == []
    again = LLaDAConfig.from_dict(json.loads(llada.to_json_string(use_diff=False)))
    assert (again.vocab_size, again.text_vocab_size) == (576, published["vocab_size"])
    capabilities = model_capabilities(llada)
    assert (capabilities.family, capabilities.attention, capabilities.shifted_logits) == (
        "LLaDA", "full", False)

    dream = AutoConfig.from_pretrained(dream_checkpoint)
    published = config_of(dream_checkpoint)
    assert isinstance(dream, DreamConfig)
    assert (dream.vocab_size, dream.mask_token_id, dream.num_key_value_heads) == (
        600, published["mask_token_id"], published["num_key_value_heads"])
    assert dream.rope_parameters["rope_theta"] == published["rope_theta"]
    capabilities = model_capabilities(dream)
    assert (capabilities.family, capabilities.attention, capabilities.shifted_logits) == (
        "Dream", "full", True)
    # the whole canvas is one block of the config's block size (not a published key)
    assert capabilities.whole_canvas and dream.block_size == 256
    assert dict(capabilities.option_defaults) == {"strategy": "timestep_schedule",
                                                  "alg": "maskgit_plus"}


def test_llada_config_derived_names():
    from vllm_diffusion.models.full_attention_configs import DreamConfig, LLaDAConfig

    assert LLaDAConfig(n_heads=8, n_kv_heads=None).num_key_value_heads == 8
    assert LLaDAConfig(n_heads=8, multi_query_attention=True).num_key_value_heads == 1
    assert LLaDAConfig(d_model=64, mlp_ratio=3).intermediate_size == 192
    assert LLaDAConfig(weight_tying=True).tie_word_embeddings is True
    assert LLaDAConfig().mask_token_id == 126336 and DreamConfig().mask_token_id == 151666
    unserved = LLaDAConfig(block_type="sequential", rope=True, layer_norm_type="rms",
                           activation_type="silu").unserved_settings()
    assert len(unserved) == 1 and unserved[0].startswith("block_type='sequential'")
    with pytest.raises(ValueError, match="embedding_size"):
        LLaDAConfig(vocab_size=600, embedding_size=512)
