"""The full-attention exact mode (LLaDA's published loop: every step recomputes prompt and
canvas) against stock vLLM autoregressive decoding of the same weights, next to the
block-diffusion embedded model against its own, at equal work.

Configurations (each engine in this process, one at a time, alternating over
``--rounds``):

- ``llada exact``: ``--llada`` (default ``checkpoints/llada-small-chat``, 9 layers, d 256)
  through the plugin, greedy, block ``--llada-block`` (32, the published examples'),
  ``max_tokens`` the canvas (``--canvas``, 128: the canvas it was trained on), one token
  per step (the published ``steps = gen_length``), ending at the first stop token;
- ``autoregressive as llada exact``: the same weights relabelled ``LlamaForCausalLM``
  (``bench.llama_copy``), stock vLLM at its defaults, generating per request exactly as
  many tokens as the plugin did (``ignore_eos``);
- ``sdar standard B=4`` and ``autoregressive as sdar standard B=4``: the default
  block-diffusion model (12 layers, d 256) and its Qwen3 twin, the same way.

For batch size b, b chat requests (the evaluation families interleaved) are submitted at
once, repeated until ``--min-requests`` ran. Reported per batch size: tokens/s (median over
rounds), the ratio to the configuration's autoregressive twin, rows computed per committed
token (the plugin's counters; for autoregressive decoding, prompt plus output tokens per
output token) and exact-match accuracy. JSON and a PNG.

    python benchmarks/full_attention_vs_ar.py [--batch-sizes 1 4 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile

import harness

LLADA = "llada exact"
SDAR = "sdar standard B=4"
AR_AS = "autoregressive as "


def measure(llm, prompts, examples, batch: int, min_requests: int, max_tokens: int,
            lengths: list[int] | None, diffusion: bool) -> dict:
    """``lengths``: the autoregressive side's output length per request (equal work)."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.quality.corpus import score

    tokens = rows = seconds = correct = done = 0
    produced: list[int] = []
    while done < max(min_requests, batch):
        indices = [(done + i) % len(prompts) for i in range(batch)]
        params = (SamplingParams(temperature=0, max_tokens=max_tokens) if lengths is None
                  else [SamplingParams(temperature=0, max_tokens=max(lengths[done + i], 1),
                                       ignore_eos=True) for i in range(batch)])
        run = harness.generate(llm, [prompts[i] for i in indices], params, counters=diffusion)
        seconds += run.seconds
        for index, out in zip(indices, run.outputs):
            produced.append(len(out.outputs[0].token_ids))
            if lengths is None:
                example = examples[index]
                correct += score(example.family, example.answer, out.outputs[0].text)
            if not diffusion:
                rows += len(out.prompt_token_ids) + produced[-1]
        if diffusion:
            rows += run.stats["positions_computed"]
        tokens += run.output_tokens
        done += batch
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens, "lengths": produced,
            "rows_per_committed_token": rows / max(tokens, 1),
            "accuracy": correct / done if lengths is None else None}


def run_model(name: str, args, models: dict, examples, recorded: dict) -> dict[int, dict]:
    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm
    from vllm_diffusion_lab.quality.harness import chat_prompts

    target = name.removeprefix(AR_AS)
    diffusion = target == name
    batch_max = max(args.batch_sizes)
    if not diffusion:
        engine = autoregressive_llm(models[name], max_num_seqs=batch_max, max_model_len=1024)
    elif name == LLADA:
        engine = diffusion_llm(models[name], diffusion_block_size=args.llada_block,
                               max_model_len=1024, max_num_seqs=batch_max,
                               enforce_eager=False)
    else:
        engine = diffusion_llm(models[name], diffusion_block_size=4, max_model_len=1024,
                               max_num_seqs=batch_max, enforce_eager=False)
    results = {}
    with engine as llm:
        prompts = chat_prompts(llm.get_tokenizer(), examples)
        measure(llm, prompts, examples, 1, 1, 8, None if diffusion else [8], diffusion)
        for batch in args.batch_sizes:
            lengths = None if diffusion else recorded[target][batch]
            result = measure(llm, prompts, examples, batch, args.min_requests, args.canvas,
                             lengths, diffusion)
            if diffusion:
                recorded.setdefault(name, {})[batch] = result["lengths"]
            results[batch] = result
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/full_attention_vs_ar.json",
                               batch_sizes=[1, 4, 16], rounds=3)
    parser.add_argument("--llada", default=str(harness.ROOT / "checkpoints/llada-small-chat"))
    parser.add_argument("--llada-block", type=int, default=32)
    parser.add_argument("--canvas", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=16)
    args = parser.parse_args()
    harness.engines_in_process()

    from vllm_diffusion_lab.bench import autoregressive_copy, llama_copy
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    examples = mixed_eval_examples(max(args.batch_sizes + [args.min_requests]))
    sdar = pathlib.Path(harness.model_path(args))
    with tempfile.TemporaryDirectory() as tmp:
        models = {LLADA: pathlib.Path(args.llada), SDAR: sdar,
                  AR_AS + LLADA: llama_copy(pathlib.Path(args.llada), pathlib.Path(tmp)),
                  AR_AS + SDAR: autoregressive_copy(sdar, pathlib.Path(tmp))}
        recorded: dict[str, dict[int, list[int]]] = {}
        order = [LLADA, AR_AS + LLADA, SDAR, AR_AS + SDAR]  # a twin after its plugin run
        measured = harness.alternate(order, args.rounds, lambda name: run_model(
            name, args, models, examples, recorded))
    rows = []
    for name, rounds in measured.items():
        for batch, runs in harness.by_batch(rounds).items():
            twin = None if name.startswith(AR_AS) else measured[AR_AS + name]
            ar = (None if twin is None else
                  statistics.median(r[batch]["tokens_per_s"] for r in twin))
            rows.append({**harness.speed_row(name, batch, runs, ar),
                         "accuracy": (None if runs[0]["accuracy"] is None else
                                      statistics.mean(r["accuracy"] for r in runs))})
    report = {"machine": f"{os.cpu_count()} CPU cores", "llada": args.llada,
              "llada_block": args.llada_block, "canvas": args.canvas, "sdar": str(sdar),
              "rounds": args.rounds, "min_requests": args.min_requests, "rows": rows,
              "package": harness.package_files()}
    harness.write_report(report, args.out, plot)
    print("| config | batch | tokens/s | / AR | rows / token | accuracy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["ratio_to_autoregressive"]
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        print(f"| {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{'-' if ratio is None else f'{ratio:.3f}'} | "
              f"{r['rows_per_committed_token']:.1f} | {accuracy} |")


def plot(report: dict, path: pathlib.Path) -> None:
    harness.plot_speed_and_rows(report, path, dashed=lambda label: label.startswith(AR_AS))


if __name__ == "__main__":
    main()
