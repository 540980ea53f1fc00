"""How much of an ES-dLLM step goes to ES-dLLM's own skipping (the importance of Eq. 1,
the ranking, the cache update)?

Times, inside one ES-dLLM run at vLLM's default compilation, the step's hook set-up and
its skip-layer hooks, against the wall time of the whole run (default model, every
request generating ``--max-tokens`` tokens, ``ignore_eos``).

    python benchmarks/es_overhead.py [--block-size 32] [--batch-size 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections

from focus_overhead import timed, timed_rounds, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/es_overhead.json")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion.policies import es
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    totals: collections.Counter = collections.Counter()
    es.EsHooks.__init__ = timed(totals, "hook_setup", es.EsHooks.__init__)
    es.EsHooks.after_output = timed(totals, "skip_layers", es.EsHooks.after_output)
    model = str(default_model_path())
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.batch_size, enforce_eager=False,
                       additional_config={"diffusion_policy": "es"}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), mixed_eval_examples(args.batch_size))
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        reports = timed_rounds(llm, prompts, params, args.rounds, totals)
    write_report({"model": model, "block_size": args.block_size,
                  "batch_size": args.batch_size}, reports, args.out)


if __name__ == "__main__":
    main()
