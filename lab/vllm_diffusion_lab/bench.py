"""Helpers the benchmark scripts share: a ``vllm bench serve`` run against a loopback
server, its ShareGPT-format dataset written from the evaluation split, and the
autoregressive twin of a diffusion checkpoint (the baseline every user already has)."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess


def write_sharegpt(path: pathlib.Path, num_conversations: int) -> None:
    """A ShareGPT-format JSON file of evaluation problems (families interleaved)."""
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    conversations = [{"id": str(i), "conversations": [
        {"from": "human", "value": e.prompt}, {"from": "gpt", "value": e.answer}]}
        for i, e in enumerate(mixed_eval_examples(num_conversations))]
    path.write_text(json.dumps(conversations))


def run_bench_serve(url: str, model: str, dataset: str, rate: str, out_dir: pathlib.Path,
                    sharegpt: pathlib.Path, *, num_prompts: int, input_len: int,
                    output_len: int) -> dict:
    """``vllm bench serve`` at one request rate with the ``random`` dataset (``input_len``
    prompt tokens, exactly ``output_len`` output tokens) or the ShareGPT file; its result
    JSON is kept in ``out_dir``; returns the summary fields and the diffusion counters."""
    from vllm_diffusion_lab.fixtures.server import vllm_command

    name = f"{dataset}_rate{rate}.json"
    command = [vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", model, "--num-prompts", str(num_prompts),
               "--request-rate", rate, "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--save-result",
               "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm",
               "--seed", "0"]
    if dataset == "random":
        command += ["--dataset-name", "random", "--random-input-len", str(input_len),
                    "--random-output-len", str(output_len), "--ignore-eos"]
    else:
        command += ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    result = json.loads((out_dir / name).read_text())
    return {"dataset": dataset, "request_rate": rate,
            **{k: result.get(k) for k in (
                "completed", "failed", "duration", "total_output_tokens", "output_throughput",
                "request_throughput", "mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms",
                "p90_tpot_ms", "p90_itl_ms", "p90_e2el_ms")},
            "diffusion": {k: v for k, v in result.items() if "diffusion" in k or "committed" in k
                          or "denois" in k}}


def autoregressive_copy(checkpoint: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """The checkpoint with its config naming Qwen3 (the same weights, decoded AR)."""
    target = into / "autoregressive"
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    for key in ("block_size", "mask_token_id"):
        config.pop(key, None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


# LLaDA's published weight names -> Llama's (vLLM's ``LlamaForCausalLM``), in order: the
# output layer before the blocks' ``ff_out``
LLADA_TO_LLAMA = (("model.transformer.ff_out.", "lm_head."),
                  ("model.transformer.wte.", "model.embed_tokens."),
                  ("model.transformer.ln_f.", "model.norm."),
                  ("model.transformer.blocks.", "model.layers."),
                  (".attn_norm.", ".input_layernorm."), (".ff_norm.", ".post_attention_layernorm."),
                  (".q_proj.", ".self_attn.q_proj."), (".k_proj.", ".self_attn.k_proj."),
                  (".v_proj.", ".self_attn.v_proj."), (".attn_out.", ".self_attn.o_proj."),
                  (".ff_proj.", ".mlp.gate_proj."), (".up_proj.", ".mlp.up_proj."),
                  (".ff_out.", ".mlp.down_proj."))


def llama_copy(checkpoint: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A LLaDA 1.x checkpoint (``block_type: llama``) as ``LlamaForCausalLM``: the same
    weights under Llama's names (its network is Llama's without the causal mask), decoded
    autoregressively by stock vLLM."""
    from safetensors.torch import load_file, save_file

    target = into / "autoregressive-llama"
    target.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, target / item.name)
    weights = {}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        for old, new in LLADA_TO_LLAMA:
            name = name.replace(old, new, 1) if old in name else name
        weights[name] = tensor
    save_file(weights, target / "model.safetensors")
    source = json.loads((checkpoint / "config.json").read_text())
    heads = source["n_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": source["d_model"], "num_attention_heads": heads,
        "num_key_value_heads": source.get("n_kv_heads") or heads,
        "num_hidden_layers": source["n_layers"],
        "intermediate_size": source["mlp_hidden_size"],
        "head_dim": source["d_model"] // heads, "hidden_act": "silu",
        "rms_norm_eps": source["rms_norm_eps"], "rope_theta": source["rope_theta"],
        "vocab_size": source.get("embedding_size") or source["vocab_size"],
        "max_position_embeddings": source["max_sequence_length"],
        "tie_word_embeddings": bool(source.get("weight_tying")),
        "eos_token_id": source.get("eos_token_id"), "pad_token_id": source.get("pad_token_id"),
        "torch_dtype": source.get("torch_dtype", "float32"),
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
