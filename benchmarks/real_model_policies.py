"""The seed methods on the converted default (SmolLM2-135M-Instruct as block diffusion):
each policy against ``standard``, side by side in one run, at batch 1 / 4 / 16 / 64, with
paired accuracy on the real model's definite questions.

Speed (equal work): fixed-length greedy outputs (``ignore_eos``, ``--max-tokens``) of the
evaluation prompts (``real_model/evaluation_set.py``, definite and open interleaved); for
batch b, b requests at once, repeated until ``--min-requests`` have run. Each round opens
one engine per policy (compiled unless ``--eager``; the policies alternate), so each
figure is a median over ``--rounds`` rounds, every round kept. Reported per policy and
batch: output tokens/s, the ratio to ``standard`` (of the medians, and per round), rows
computed per committed token (all rows, prompt and commits included), block rows per
committed token at layers 0-1 and after eviction (the later layers), and tokens committed
per denoising step.

Accuracy: in the first round, each policy answers the definite questions greedily (stop
token or ``--accuracy-tokens``), scored as ``real_model_quality`` scores them; the paired
difference to ``standard`` with its 95% interval.

    python benchmarks/real_model_policies.py [--policies standard focus] [--rounds 3]
    python benchmarks/real_model_policies.py --policies standard standard+chunk2 elastic \
        --options '{"standard+chunk2": {"chunk_size": 2, "chunk_reuse": true}}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import harness


def fixed_length_run(llm, prompts: list, batch: int, min_requests: int,
                     max_tokens: int) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = harness.diffusion_counters(llm)
    done = tokens = 0
    start = time.perf_counter()
    while done < max(min_requests, batch):
        chunk = [prompts[(done + i) % len(prompts)] for i in range(batch)]
        tokens += sum(len(o.outputs[0].token_ids)
                      for o in llm.generate(chunk, [params] * batch, use_tqdm=False))
        done += batch
    wall = time.perf_counter() - start
    stats = stats_delta(before, harness.diffusion_counters(llm))
    return {"tokens_per_s": tokens / wall, "output_tokens": tokens / done,
            "rows_per_committed_token": stats["all_positions_per_committed_token"],
            "block_rows_per_token_layers_0_1": stats["block_positions_per_committed_token"],
            "block_rows_per_token_later_layers":
                stats["later_layer_positions_per_committed_token"],
            "tokens_per_step": stats["tokens_committed_per_denoising_step"]}


def definite_accuracy(llm, tokenizer, max_tokens: int, limit: int | None) -> list[bool]:
    from vllm_diffusion_lab.real_model.evaluation import STOP, chat_prompt_ids, generate
    from vllm_diffusion_lab.real_model.evaluation_set import DEFINITE_QUESTIONS, score_definite

    questions = DEFINITE_QUESTIONS[:limit]
    ids = chat_prompt_ids(tokenizer, [q.prompt for q in questions])
    answers = generate(llm, ids, 0.0, max_tokens)
    return [score_definite(q, tokenizer.decode(a).split(STOP)[0])
            for q, a in zip(questions, answers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/real_model_policies.json",
                               batch_sizes=(1, 4, 16, 64), rounds=3, max_tokens=64)
    parser.add_argument("--policies", nargs="+", default=["standard", "focus"],
                        help="configurations: a policy's name, or a name --options defines")
    parser.add_argument("--options", default="{}",
                        help="JSON: configuration name -> engine options (additional_config; "
                             "'diffusion_policy' defaults to the name)")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--accuracy-tokens", type=int, default=64)
    parser.add_argument("--accuracy-limit", type=int, default=None,
                        help="the first N definite questions (default: all)")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    harness.engines_in_process()
    from transformers import AutoTokenizer

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.real_model.evaluation import (chat_prompt_ids,
                                                          paired_accuracy_interval)
    from vllm_diffusion_lab.real_model.evaluation_set import DEFINITE_QUESTIONS, OPEN_REQUESTS

    model = args.model or str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [p for pair in zip((q.prompt for q in DEFINITE_QUESTIONS), OPEN_REQUESTS)
             for p in pair]
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids(tokenizer, texts)]
    options = json.loads(args.options)
    cells: dict[tuple[str, int], list[dict]] = {}
    correct: dict[str, list[bool]] = {}
    for index in range(args.rounds):
        for policy in args.policies:
            start = time.perf_counter()
            config = {"diffusion_policy": policy.split("+")[0], **options.get(policy, {})}
            with diffusion_llm(model, max_model_len=1024, max_num_seqs=max(args.batch_sizes),
                               enforce_eager=args.eager, additional_config=config) as llm:
                fixed_length_run(llm, prompts, 1, 1, 8)  # warm-up
                for batch in args.batch_sizes:
                    cells.setdefault((policy, batch), []).append(fixed_length_run(
                        llm, prompts, batch, args.min_requests, args.max_tokens))
                if index == 0:
                    correct[policy] = definite_accuracy(llm, tokenizer, args.accuracy_tokens,
                                                        args.accuracy_limit)
            print(f"round {index + 1}/{args.rounds}: {policy} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    base = args.policies[0]
    rows = []
    for policy in args.policies:
        for batch in args.batch_sizes:
            runs = cells[(policy, batch)]
            row = {"config": policy, "batch_size": batch,
                   **harness.median_of(runs, "tokens_per_s", "tokens_per_s_rounds"),
                   **{key: statistics.mean(r[key] for r in runs) for key in runs[0]
                      if key != "tokens_per_s"}}
            base_runs = cells[(base, batch)]
            row["ratio_to_" + base] = harness.ratio(
                row["tokens_per_s"], statistics.median(r["tokens_per_s"] for r in base_runs))
            row["ratio_each_round"] = [r["tokens_per_s"] / b["tokens_per_s"]
                                       for r, b in zip(runs, base_runs)]
            rows.append(row)
    accuracy = {policy: {"accuracy": sum(c) / len(c),
                         "paired_difference_to_" + base: paired_accuracy_interval(
                             correct[policy], correct[base])}
                for policy, c in correct.items()}
    report = {"machine": "2-core CPU", "model": model, "compiled": not args.eager,
              "options": options, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "min_requests": args.min_requests, "definite_questions": len(correct[base]),
              "accuracy_tokens": args.accuracy_tokens, "accuracy": accuracy, "rows": rows}
    harness.write_report(report, args.out, lambda r, p: harness.plot_speed_and_rows(
        r, p, dashed=lambda label: label == base))
    print(f"| policy | batch | tok/s | vs {base} | rounds | rows/token | later-layer block "
          f"rows/token | tokens/step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['batch_size']} | {row['tokens_per_s']:.1f} | "
              f"{row['ratio_to_' + base]:.2f} | "
              f"{' / '.join(f'{x:.2f}' for x in row['ratio_each_round'])} | "
              f"{row['rows_per_committed_token']:.2f} | "
              f"{row['block_rows_per_token_later_layers']:.2f} | "
              f"{row['tokens_per_step']:.2f} |")
    print(json.dumps(accuracy))


if __name__ == "__main__":
    main()
