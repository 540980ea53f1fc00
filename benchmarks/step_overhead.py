"""Where a denoising step's time goes: the model versus everything around it.

For each batch size and block size, runs ``--requests-per-slot x batch`` greedy requests
(``ignore_eos``, so the batch stays full) through the in-process engine and splits the wall
time of the runner's ``execute_model`` into

- model: the model forward plus ``compute_logits``;
- other: everything else in ``execute_model`` (planning, metadata, policy, sampling,
  bookkeeping): the overhead that should not grow with the batch.

    python benchmarks/step_overhead.py --batch-sizes 8 32 64 --block-sizes 4 32
writes results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


class StepTimer:
    """Wraps the runner's execute_model and its model's forward / compute_logits."""

    def __init__(self, runner) -> None:
        self.total = self.model = 0.0
        self.steps = 0
        execute, forward, logits = runner.execute_model, runner.model.forward, \
            runner.model.compute_logits

        def timed(fn, attr):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)
            return wrapper

        def timed_execute(*args, **kwargs):
            self.steps += 1
            return timed(execute, "total")(*args, **kwargs)

        runner.execute_model = timed_execute
        runner.model.forward = timed(forward, "model")
        runner.model.compute_logits = timed(logits, "model")

    def reset(self) -> None:
        self.total = self.model = 0.0
        self.steps = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results/step_overhead.json")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    model = default_model_path()
    rows = []
    for block in args.block_sizes:
        for batch in args.batch_sizes:
            with diffusion_llm(model, diffusion_block_size=block, max_num_seqs=batch,
                               max_model_len=512,
                               additional_config={"diffusion_policy": args.policy}) as llm:
                runner = (llm.llm_engine.engine_core.engine_core.model_executor
                          .driver_worker.worker.model_runner)
                timer = StepTimer(runner)
                tokenizer = llm.get_tokenizer()
                examples = mixed_eval_examples(batch * args.requests_per_slot)
                prompts = [tokenizer.apply_chat_template(
                    [{"role": "user", "content": e.prompt}], add_generation_prompt=True,
                    tokenize=False) for e in examples]
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                        ignore_eos=True)
                llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up
                timer.reset()
                llm.generate(prompts, params, use_tqdm=False)
                other = timer.total - timer.model
                row = {"block_size": block, "batch_size": batch, "steps": timer.steps,
                       "execute_model_ms_per_step": 1e3 * timer.total / timer.steps,
                       "model_ms_per_step": 1e3 * timer.model / timer.steps,
                       "other_ms_per_step": 1e3 * other / timer.steps,
                       "other_share": other / timer.total}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"policy": args.policy, "model": str(model),
                                    "max_tokens": args.max_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
