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
  selection included) and the rest of the step;
- the share of requests whose whole output equals ``standard``'s (fidelity of the
  sparsity, meaningful even where the model cannot solve the task).

Prefix caching is off, so every configuration prefills its prompts (the same prompts run
once per configuration). The default strategy commits one position per step (``low_confidence_static`` with
``denoising_steps`` = block size: the papers' steps = generation length regime), so most
of a block's steps come after the selection step.

    python benchmarks/long_context.py [--model DIR] \
        --lengths 1024 2048 3968 --block-size 32 --ratios 0.5 0.3 0.1
writes results/long_context.json and .png. Without ``--model`` it runs the default model
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
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOKENS_PER_WORD = 1.22  # the project tokenizer on filler text (measured)


class StepTimes:
    """Wraps the runner's ``execute_model`` and the attention backend's forward; keeps,
    per step, its wall time, its attention time and whether it prefilled prompt rows."""

    def __init__(self, runner, block_size: int) -> None:
        from vllm_diffusion.attention import backend

        self.steps: list[tuple[float, float, bool]] = []
        self.attention = 0.0
        execute = runner.execute_model
        impl_forward = backend.BlockDiffusionAttentionImpl.forward

        def timed_attention(impl, *args, **kwargs):
            start = time.perf_counter()
            try:
                return impl_forward(impl, *args, **kwargs)
            finally:
                self.attention += time.perf_counter() - start

        def timed_execute(scheduler_output, *args, **kwargs):
            self.attention, start = 0.0, time.perf_counter()
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                scheduled = scheduler_output.num_scheduled_tokens.values()
                prefill = any(n > 2 * block_size for n in scheduled)
                self.steps.append((time.perf_counter() - start, self.attention, prefill))

        runner.execute_model = timed_execute
        backend.BlockDiffusionAttentionImpl.forward = timed_attention
        self.restore = lambda: setattr(backend.BlockDiffusionAttentionImpl, "forward",
                                       impl_forward)

    def denoising(self) -> dict[str, float]:
        rows = [(wall, attention) for wall, attention, prefill in self.steps if not prefill]
        if not rows:
            return {"steps": 0}
        walls, attentions = zip(*rows)
        return {"steps": len(rows), "step_ms": 1e3 * statistics.mean(walls),
                "attention_ms": 1e3 * statistics.mean(attentions),
                "rest_ms": 1e3 * (statistics.mean(walls) - statistics.mean(attentions))}


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


def run_cell(llm, timer: StepTimes, prompts, answers, options, max_tokens) -> dict:
    """Every request generates ``max_tokens`` (``ignore_eos``: equal work for every policy);
    the answer is read up to the first end-of-turn token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    timer.steps.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    texts = [answer_text(tokenizer, list(o.outputs[0].token_ids)) for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"accuracy": sum(t == a for t, a in zip(texts, answers)) / len(answers),
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "output_tokens_per_s": tokens / wall, "wall_s": wall,
            "samples": texts[:3], **timer.denoising()}


def plot(cells: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accuracy) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(c["label"] for c in cells):
        rows = [c for c in cells if c["label"] == label]
        lengths = [c["prompt_tokens"] for c in rows]
        speed.plot(lengths, [c["denoising_speedup"] for c in rows], marker="o", label=label)
        accuracy.plot(lengths, [c["accuracy"] for c in rows], marker="o", label=label)
    speed.set(xlabel="prompt tokens", ylabel="denoising step time, standard / policy",
              title="speed of denoising steps")
    accuracy.set(xlabel="prompt tokens", ylabel="retrieval accuracy", ylim=(-0.05, 1.05),
                 title="accuracy")
    speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    # 3,968: the longest prompt that leaves room for 64 output tokens and block padding in
    # a 4,096-position context
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3968])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.3, 0.1])
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--strategy", default="low_confidence_static")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results/long_context.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm

    args.model = args.model or str(default_model_path())
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
            runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                      .worker.model_runner)
            timer = StepTimes(runner, args.block_size)
            tokenizer = llm.get_tokenizer()
            try:
                warm_prompts, warm_answers = problems(tokenizer, 256, 2, seed=1)
                run_cell(llm, timer, warm_prompts, warm_answers, strategy, 8)
                for length in args.lengths:
                    prompts, answers = problems(tokenizer, length, args.problems, seed=length)
                    lengths[length] = statistics.mean(len(tokenizer(p)["input_ids"])
                                                      for p in prompts)
                    for label, name, options in configs:
                        if name != policy:
                            continue
                        cell = run_cell(llm, timer, prompts, answers, {**strategy, **options},
                                        args.max_tokens)
                        results[label, length] = cell
                        print(f"{length:>5} {label:<14} acc {cell['accuracy']:.2f}  "
                              f"{cell['output_tokens_per_s']:7.1f} tok/s  step "
                              f"{cell.get('step_ms', 0):7.1f} ms (attention "
                              f"{cell.get('attention_ms', 0):6.1f})", flush=True)
            finally:
                timer.restore()
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "block_size": args.block_size,
                                    "problems": args.problems, "strategy": strategy,
                                    "cells": cells}, indent=2) + "\n")
    plot(cells, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
