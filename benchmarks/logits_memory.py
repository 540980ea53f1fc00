"""Peak resident memory of a step's logits: how much it grows from batch 1 to batch 64.

A diffusion step makes logits for every computed block position, batch x block x
vocabulary of them. One in-process eager engine per configuration, each in a fresh
process (``ru_maxrss`` only grows; ``harness.run_child``): a tiny random SDAR with a large
vocabulary (LLaDA2's 157,184 by default), block 32, 24-token prompts, 64 output tokens
each (``ignore_eos``, no detokenisation: ids past the tokenizer have no text), a batch-1
run then a batch-64 run; the growth of the peak between the two is what the batch adds. Configurations: the
engine's default logits budget (``diffusion_logits_memory_mib``) and one large enough that
the whole step's logits exist at once (what every step did before chunking), both greedy;
and the default budget with sampled requests (temperature 0.8, top-p 0.9, seeded) asking
for 5 top logprobs each (the sampled path's sort and the logprob copy). Also checks that
the two greedy runs produce the same tokens. JSON to ``--out``.

    python benchmarks/logits_memory.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource

import harness

MODEL = harness.ROOT / "results/large-vocab-sdar"
UNBOUNDED_MIB = 1 << 20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(model: pathlib.Path, budget: int | None, sampled: bool, args) -> dict:
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_diffusion_lab.offline import diffusion_llm

    engine = {"diffusion_policy": "standard"}
    if budget is not None:
        engine["diffusion_logits_memory_mib"] = budget
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(16, 250) for _ in range(24)])
               for _ in range(max(args.batch_sizes))]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    if sampled:
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=5,
                                max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    result = {"budget_mib": budget, "peaks_mib": {}, "tokens": {}}
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=256,
                       max_num_seqs=max(args.batch_sizes), additional_config=engine) as llm:
        for batch in args.batch_sizes:
            outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
            result["peaks_mib"][batch] = peak_mib()
            result["tokens"][batch] = [list(o.outputs[0].token_ids) for o in outputs]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=157_184)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: budget
    harness.add_common_options(parser, out="results/logits_memory.json", batch_sizes=[1, 64],
                               max_tokens=64, model=False)
    args = parser.parse_args()
    if args.one is not None:  # a child process: one configuration
        name, _, kind = args.one.partition(":")
        budget = None if name == "default" else int(name)
        print(json.dumps(measure(MODEL, budget, kind == "sampled", args)))
        return
    from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

    build_tiny_sdar(MODEL, block_size=args.block_size, model_vocab_size=args.vocab)
    labels = {"default": "default budget", str(UNBOUNDED_MIB): "whole step at once",
              "default:sampled": "default budget, sampled with 5 logprobs"}
    runs = {name: harness.run_child([__file__, "--one", name, "--block-size", args.block_size,
                                     "--max-tokens", args.max_tokens, "--batch-sizes",
                                     *args.batch_sizes]) for name in labels}
    first, last = str(min(args.batch_sizes)), str(max(args.batch_sizes))
    report = {"vocab": args.vocab, "block_size": args.block_size, "configs": {}}
    for name, run in runs.items():
        peaks = run["peaks_mib"]
        report["configs"][name] = {"peaks_mib": peaks, "growth_mib": peaks[last] - peaks[first]}
        label = labels[name]
        print(f"{label}: peak after batch {first} {peaks[first]:.0f} MiB, after batch "
              f"{last} {peaks[last]:.0f} MiB, growth {peaks[last] - peaks[first]:.0f} MiB")
    same = runs["default"]["tokens"] == runs[str(UNBOUNDED_MIB)]["tokens"]
    report["same_tokens"] = same
    print("same tokens with and without chunks:", same)
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
