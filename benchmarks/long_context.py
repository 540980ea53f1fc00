"""Long prompts: ``standard`` against ``sparse_prefix`` at several retention ratios, side
by side in one run.

For each prompt length (in tokens, with the chat template), ``--problems`` held-out
retrieval problems (``vllm_diffusion_lab/quality/retrieval.py``: secret numbers planted in filler text, one
asked for) are submitted at once, greedily, through a ``standard`` engine and a
``sparse_prefix`` engine (the ratios as per-request options). Reported per cell:

- accuracy (exact match of the four digits);
- output tokens/s end to end (prefill included; every request generates ``--max-tokens``
  tokens, ``ignore_eos``, and its answer is read up to its end-of-turn token) and the time
  of the denoising steps
  (steps with no prompt prefill), split into attention (the attention backend's forward,
  selection included) and the rest of the step (``step_timing.StepClock``);
- the share of requests whose whole output equals ``standard``'s (fidelity of the
  sparsity, meaningful even where the model cannot solve the task).

Prefix caching is off, so every configuration prefills its prompts (the same prompts run
once per configuration). The default strategy commits one position per step (``low_confidence_static`` with
``denoising_steps`` = block size: the papers' steps = generation length regime), so most
of a block's steps come after the selection step.

    python benchmarks/long_context.py [--model DIR] \
        --lengths 1024 2048 3968 --block-size 32 --ratios 0.5 0.3 0.1
writes results/long_context.json and .png. Without ``--model`` it runs the embedded model
(``vllm_diffusion.default_model``). The figures in ``benchmarks/RESULTS.md`` were made with
the 12-layer model trained from scratch (``sdar-small-scratch``, whose weights are not kept
in the repository); its five stages are reproducible with the commands in
``training/README.md``, then ``--model`` pointing at the result.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import harness
from step_timing import StepClock, mean_ms, model_runner

TOKENS_PER_WORD = 1.22  # the project tokenizer on filler text (measured)


def step_clock(runner, block_size: int) -> StepClock:
    """Each of the runner's steps (``execute_model``) timed, noted as prefilling prompt rows
    or not, with the attention backend's forward timed inside it."""
    from vllm_diffusion.attention import backend

    def prefills(scheduler_output, *args, **kwargs) -> bool:
        return any(n > 2 * block_size for n in scheduler_output.num_scheduled_tokens.values())

    clock = StepClock()
    clock.wrap(runner, "execute_model", "step", step=True, note=prefills)
    clock.wrap(backend.BlockDiffusionAttentionImpl, "forward", "attention")
    return clock


def denoising(clock: StepClock) -> dict[str, float]:
    """Mean wall and attention time of the steps without prompt prefill."""
    steps = [s.seconds for s in clock.steps if not s.note]
    if not steps:
        return {"steps": 0}
    times = mean_ms(steps, ("step", "attention"))
    return {"steps": len(steps), "step_ms": times["step"], "attention_ms": times["attention"],
            "rest_ms": times["step"] - times["attention"]}


def problems(tokenizer, length: int, count: int, seed: int) -> tuple[list[str], list[str]]:
    """``count`` held-out retrieval problems whose chat prompts are about ``length`` tokens."""
    from vllm_diffusion_lab.quality.retrieval import retrieval_examples

    words = max(0, round((length - 40) / TOKENS_PER_WORD))
    examples = retrieval_examples(count, seed, (words, words))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}],
                                             tokenize=False, add_generation_prompt=True)
               for e in examples]
    return prompts, [e.answer for e in examples]


def answer_text(tokenizer, token_ids: list[int]) -> str:
    """The response up to its first end-of-turn or padding token."""
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
    return tokenizer.decode(token_ids[:end], skip_special_tokens=True).strip()


def run_cell(llm, clock: StepClock, prompts, answers, options, max_tokens) -> dict:
    """Every request generates ``max_tokens`` (``ignore_eos``: equal work for every policy);
    the answer is read up to the first end-of-turn token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    clock.clear()
    run = harness.generate(llm, prompts, params)
    tokenizer = llm.get_tokenizer()
    texts = [answer_text(tokenizer, ids) for ids in run.token_ids()]
    return {"accuracy": sum(t == a for t, a in zip(texts, answers)) / len(answers),
            "token_ids": run.token_ids(), "output_tokens_per_s": run.tokens_per_s,
            "wall_s": run.seconds, "samples": texts[:3], **denoising(clock)}


def plot(report: dict, path: pathlib.Path) -> None:
    speed: dict[str, list] = {}
    accuracy: dict[str, list] = {}
    for c in report["cells"]:
        speed.setdefault(c["label"], []).append((c["prompt_tokens"], c["denoising_speedup"]))
        accuracy.setdefault(c["label"], []).append((c["prompt_tokens"], c["accuracy"]))
    harness.plot_panels(path, [
        harness.Panel("speed of denoising steps", "prompt tokens",
                      "denoising step time, standard / policy", speed, log2_x=False),
        harness.Panel("accuracy", "prompt tokens", "retrieval accuracy", accuracy,
                      log2_x=False)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # 3,968: the longest prompt that leaves room for 64 output tokens and block padding in
    # a 4,096-position context
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3968])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.3, 0.1])
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--strategy", default="low_confidence_static")
    harness.add_common_options(parser, out="results/long_context.json", max_tokens=64)
    args = parser.parse_args()

    from vllm_diffusion_lab.offline import diffusion_llm

    args.model = harness.model_path(args)
    strategy = {"strategy": args.strategy, "denoising_steps": args.block_size}
    context = json.loads((pathlib.Path(args.model) / "config.json").read_text())[
        "max_position_embeddings"]
    max_model_len = max(args.lengths) + args.max_tokens + 2 * args.block_size
    if max_model_len > context:
        raise SystemExit(f"prompts of {max(args.lengths)} tokens and {args.max_tokens} output "
                         f"tokens (plus block padding) exceed the model's context of {context}")
    configs = [("standard", "standard", {})] + [
        (f"sparse r={r}", "sparse_prefix", {"retention_ratio": r}) for r in args.ratios]
    results: dict[tuple[str, int], dict] = {}
    lengths: dict[int, float] = {}
    for policy in dict.fromkeys(p for _, p, _ in configs):
        with diffusion_llm(args.model, diffusion_block_size=args.block_size,
                           max_model_len=max_model_len,
                           max_num_seqs=args.problems, enable_prefix_caching=False,
                           additional_config={"diffusion_policy": policy}) as llm:
            clock = step_clock(model_runner(llm), args.block_size)
            tokenizer = llm.get_tokenizer()
            with clock:
                warm_prompts, warm_answers = problems(tokenizer, 256, 2, seed=1)
                run_cell(llm, clock, warm_prompts, warm_answers, strategy, 8)
                for length in args.lengths:
                    prompts, answers = problems(tokenizer, length, args.problems, seed=length)
                    lengths[length] = statistics.mean(len(tokenizer(p)["input_ids"])
                                                      for p in prompts)
                    for label, name, options in configs:
                        if name != policy:
                            continue
                        cell = run_cell(llm, clock, prompts, answers, {**strategy, **options},
                                        args.max_tokens)
                        results[label, length] = cell
                        print(f"{length:>5} {label:<14} acc {cell['accuracy']:.2f}  "
                              f"{cell['output_tokens_per_s']:7.1f} tok/s  step "
                              f"{cell.get('step_ms', 0):7.1f} ms (attention "
                              f"{cell.get('attention_ms', 0):6.1f})", flush=True)
    cells = []
    for length in args.lengths:
        base = results["standard", length]
        for label, _, options in configs:
            cell = dict(results[label, length])
            token_ids = cell.pop("token_ids")
            # requests whose whole output equals standard's (the fidelity of the sparsity)
            cell["same_as_standard"] = sum(
                a == b for a, b in zip(token_ids, base["token_ids"])) / len(token_ids)
            cells.append({"label": label, "target_tokens": length,
                          "prompt_tokens": lengths[length], **options, **cell,
                          "throughput_vs_standard": (cell["output_tokens_per_s"]
                                                     / base["output_tokens_per_s"]),
                          "denoising_speedup": base["step_ms"] / cell["step_ms"]})
    harness.write_report({"model": args.model, "block_size": args.block_size,
                          "problems": args.problems, "strategy": strategy, "cells": cells},
                         args.out, plot)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
