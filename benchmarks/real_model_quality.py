"""Quality of the converted default (SmolLM2-135M-Instruct as block diffusion) against the
original, on the evaluation set (``real_model/evaluation_set.py``, disjoint from the
training prompts): definite-answer accuracy (greedy, both), the open answers' mean
per-token NLL under the original (the conversion's greedy answers against the original's
greedy answers and its samples at temperature 1.0), empty and degenerate answers, median
length and repeated 4-grams, with paired 95% intervals.

    python benchmarks/real_model_quality.py [--model DIR] [--options '{"threshold": 0.9}']

Writes ``results/real_model_quality.json`` (``--out``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm, stats_delta
from vllm_diffusion_lab.real_model import original_checkpoint
from vllm_diffusion_lab.real_model.converted import build_converted
from vllm_diffusion_lab.real_model.evaluation import (answer_nll, answer_stats,
                                                      chat_prompt_ids, generate,
                                                      paired_accuracy_interval,
                                                      paired_mean_interval)
from vllm_diffusion_lab.real_model.evaluation_set import (DEFINITE_QUESTIONS, OPEN_REQUESTS,
                                                          score_definite)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=pathlib.Path, default=None,
                        help="converted checkpoint (default: build the repository's)")
    parser.add_argument("--options", default="{}", help="diffusion options (JSON: additional_config keys)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--limit", type=int, default=None, help="first N of each half")
    parser.add_argument("--original-from", type=pathlib.Path, default=None,
                        help="reuse the original's answers of this earlier report (same "
                             "prompts and --max-tokens)")
    parser.add_argument("--original-only", action="store_true",
                        help="only the original's answers (for --original-from)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("results/real_model_quality.json"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = args.model or (None if args.original_only else build_converted())
    original = original_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(original)
    definite = DEFINITE_QUESTIONS[:args.limit]
    open_requests = list(OPEN_REQUESTS[:args.limit])
    prompts = [q.prompt for q in definite] + open_requests
    prompt_ids = chat_prompt_ids(tokenizer, prompts)
    n_def = len(definite)
    previous = json.loads(args.original_from.read_text()) if args.original_from else {}
    answers = {}
    greedy_of = dict(zip(previous.get("prompts", []),
                         previous.get("answers", {}).get("original_greedy", [])))
    sampled_of = dict(zip(previous.get("prompts", [])[previous.get("definite_questions", 0):],
                          previous.get("answers", {}).get("original_t1", [])))
    if previous.get("max_tokens") == args.max_tokens and all(p in greedy_of for p in prompts) \
            and all(p in sampled_of for p in open_requests):
        answers["original_greedy"] = [greedy_of[p] for p in prompts]
        answers["original_t1"] = [sampled_of[p] for p in open_requests]
    else:
        with autoregressive_llm(original, max_num_seqs=64) as llm:
            answers["original_greedy"] = generate(llm, prompt_ids, 0.0, args.max_tokens)
            answers["original_t1"] = generate(llm, prompt_ids[n_def:], 1.0, args.max_tokens)
    if args.original_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"prompts": prompts, "max_tokens": args.max_tokens,
                                        "definite_questions": n_def, "answers": answers}))
        return
    options = json.loads(args.options)
    with diffusion_llm(converted, max_num_seqs=64, max_model_len=1024,
                       diffusion_block_size=args.block_size,
                       additional_config=options) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        answers["converted_greedy"] = generate(llm, prompt_ids, 0.0, args.max_tokens)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = {k: [tokenizer.decode(a, skip_special_tokens=True) for a in v]
            for k, v in answers.items()}
    correct = {k: [score_definite(q, t) for q, t in zip(definite, text[k][:n_def])]
               for k in ("original_greedy", "converted_greedy")}
    scorer = AutoModelForCausalLM.from_pretrained(original, dtype="float32").eval()
    open_ids = prompt_ids[n_def:]
    nll = {"original_greedy": answer_nll(scorer, open_ids, answers["original_greedy"][n_def:],
                                         stop_id),
           "original_t1": answer_nll(scorer, open_ids, answers["original_t1"], stop_id),
           "converted_greedy": answer_nll(scorer, open_ids,
                                          answers["converted_greedy"][n_def:], stop_id)}
    both = [i for i in range(len(open_ids))
            if all(nll[k][i] is not None for k in nll)]
    report = {
        "converted": str(converted), "options": options, "block_size": args.block_size,
        "max_tokens": args.max_tokens, "definite_questions": n_def,
        "open_requests": len(open_ids),
        "tokens_per_step": round(stats["tokens_committed_per_denoising_step"], 3),
        "rows_per_committed_token": round(stats["all_positions_per_committed_token"], 3),
        "accuracy": {k: round(statistics.fmean(v), 4) for k, v in correct.items()},
        "accuracy_difference": paired_accuracy_interval(correct["converted_greedy"],
                                                        correct["original_greedy"]),
        "open_nll_mean": {k: round(statistics.fmean(v[i] for i in both), 4)
                          for k, v in nll.items()},
        "nll_difference_vs_original_t1": paired_mean_interval(
            [nll["converted_greedy"][i] for i in both], [nll["original_t1"][i] for i in both]),
        "nll_difference_vs_original_greedy": paired_mean_interval(
            [nll["converted_greedy"][i] for i in both],
            [nll["original_greedy"][i] for i in both]),
        "open_answer_stats": {k: answer_stats(v[n_def:] if k != "original_t1" else v,
                                              args.max_tokens) for k, v in answers.items()},
        "prompts": prompts, "answers": answers,
        "examples": [{"prompt": prompts[i],
                      **{k: text[k][i] for k in ("original_greedy", "converted_greedy")},
                      **({"original_t1": text["original_t1"][i - n_def]} if i >= n_def
                         else {})}
                     for i in (0, 1, 2, n_def, n_def + 1, n_def + 2) if i < len(prompts)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"| | original greedy | converted greedy | original T=1 |\n|---|---|---|---|\n"
          f"| definite accuracy | {report['accuracy']['original_greedy']} | "
          f"{report['accuracy']['converted_greedy']} | |\n"
          f"| open NLL under the original | {report['open_nll_mean']['original_greedy']} | "
          f"{report['open_nll_mean']['converted_greedy']} | "
          f"{report['open_nll_mean']['original_t1']} |")
    for k, v in report["open_answer_stats"].items():
        print(k, v)
    print("accuracy difference", report["accuracy_difference"], "tokens/step",
          report["tokens_per_step"], "rows/token", report["rows_per_committed_token"])
    print("NLL difference vs T=1", report["nll_difference_vs_original_t1"])
    for e in report["examples"]:
        print(json.dumps(e)[:600])


if __name__ == "__main__":
    main()
