"""Quality of the converted model against the original on the evaluation set
(``evaluation_set.py``): answers from either, their mean per-token NLL under the original,
degenerate-answer counts, and paired differences with 95% intervals."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from typing import Any

STOP = "<|im_end|>"


def chat_prompt_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as the checkpoint's chat template renders it (default system prompt,
    generation prompt), as token ids."""
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def generate(llm: Any, prompt_ids: list[list[int]], temperature: float, max_tokens: int,
             seed: int = 0) -> list[list[int]]:
    """Answer token ids (stop token excluded) of each prompt."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                             seed=None if temperature == 0 else seed + i)
              for i in range(len(prompt_ids))]
    results = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                           use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results]


def answer_nll(model: Any, prompt_ids: list[list[int]], answers: list[list[int]],
               stop_id: int, batch: int = 16) -> list[float | None]:
    """Mean per-token NLL of each answer (with its stop token where it ended) under
    ``model`` (a transformers causal LM), given its prompt; None for an empty answer."""
    import torch

    out: list[float | None] = []
    for start in range(0, len(answers), batch):
        rows, spans = [], []
        for prompt, answer in zip(prompt_ids[start:start + batch], answers[start:start + batch]):
            rows.append(prompt + answer)
            spans.append((len(prompt), len(answer)))
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), stop_id)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            attention[i, :len(r)] = 1
        with torch.no_grad():
            logprobs = model(input_ids=ids, attention_mask=attention).logits.log_softmax(-1)
        for i, (p, n) in enumerate(spans):
            if n == 0:
                out.append(None)
                continue
            targets = ids[i, p:p + n]
            picked = logprobs[i, p - 1:p + n - 1].gather(-1, targets[:, None])
            out.append(-picked.mean().item())
    return out


def repeated_fourgrams(ids: list[int]) -> float:
    """Fraction of an answer's 4-grams that occurred earlier in it."""
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    if not grams:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def degenerate(ids: list[int], max_tokens: int) -> bool:
    """Empty, or more than half of its 4-grams repeats, or cut at the limit while looping."""
    share = repeated_fourgrams(ids)
    return not ids or share > 0.5 or (len(ids) >= max_tokens and share > 0.2)


def answer_stats(answers: list[list[int]], max_tokens: int) -> dict[str, float]:
    lengths = [len(a) for a in answers]
    return {"empty": sum(1 for a in answers if not a),
            "degenerate": sum(degenerate(a, max_tokens) for a in answers),
            "median_length": statistics.median(lengths),
            "mean_repeated_4gram_share": statistics.fmean(map(repeated_fourgrams, answers))}


def paired_mean_interval(a: list[float], b: list[float], z: float = 1.96
                         ) -> tuple[float, float, float]:
    """Mean of a - b over pairs and its 95% normal interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    half = z * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return round(mean, 4), round(mean - half, 4), round(mean + half, 4)


def paired_accuracy_interval(ours: list[bool], theirs: list[bool], z: float = 1.96
                             ) -> tuple[float, float, float]:
    """Accuracy difference (ours - theirs) and its 95% Wald interval for paired
    proportions."""
    n = len(ours)
    gained = sum(o and not t for o, t in zip(ours, theirs))
    lost = sum(t and not o for o, t in zip(ours, theirs))
    difference = (gained - lost) / n
    variance = (gained + lost - (gained - lost) ** 2 / n) / n ** 2
    half = z * math.sqrt(max(variance, 0.0))
    return round(difference, 4), round(difference - half, 4), round(difference + half, 4)


def sample_indices(count: int, total: int, seed: int = 0) -> list[int]:
    return sorted(random.Random(seed).sample(range(total), min(count, total)))


def most_common_answers(answers: list[str], k: int = 3) -> list[tuple[str, int]]:
    return Counter(answers).most_common(k)
