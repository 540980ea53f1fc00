"""Where a denoising step's time goes: the model versus everything around it.

For each batch size and block size, runs ``--requests-per-slot x batch`` greedy requests
(``ignore_eos``, so the batch stays full) through the in-process engine and splits the wall
time of the runner's ``execute_model`` (``step_timing.StepClock``) into

- model: the model forward plus ``compute_logits``;
- other: everything else in ``execute_model`` (planning, metadata, policy, sampling,
  bookkeeping): the overhead that should not grow with the batch.

    python benchmarks/step_overhead.py --batch-sizes 8 32 64 --block-sizes 4 32
writes results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json

import harness
from step_timing import StepClock, model_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_options(parser, out="results/step_overhead.json",
                               batch_sizes=[8, 32, 64], max_tokens=64)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--requests-per-slot", type=int, default=1)
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = harness.model_path(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for block in args.block_sizes:
        for batch in args.batch_sizes:
            with diffusion_llm(model, diffusion_block_size=block, max_num_seqs=batch,
                               max_model_len=512,
                               additional_config={"diffusion_policy": args.policy}) as llm, \
                    StepClock() as clock:
                runner = model_runner(llm)
                clock.wrap(runner, "execute_model", "execute_model", step=True)
                clock.wrap(runner.model, "forward", "model")
                clock.wrap(runner.model, "compute_logits", "model")
                prompts = chat_prompts(llm.get_tokenizer(),
                                       mixed_eval_examples(batch * args.requests_per_slot))
                llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up
                clock.clear()
                llm.generate(prompts, params, use_tqdm=False)
                total, steps = clock.totals["execute_model"], len(clock.steps)
                other = total - clock.totals["model"]
                row = {"block_size": block, "batch_size": batch, "steps": steps,
                       "execute_model_ms_per_step": 1e3 * total / steps,
                       "model_ms_per_step": 1e3 * clock.totals["model"] / steps,
                       "other_ms_per_step": 1e3 * other / steps,
                       "other_share": other / total}
                rows.append(row)
                print(json.dumps(row), flush=True)
    harness.write_report({"policy": args.policy, "model": model,
                          "max_tokens": args.max_tokens, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
