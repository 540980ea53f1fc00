"""Tests for the seeded task corpus and the chat tokenizer trained on it."""

from __future__ import annotations

import re

import pytest

from vllm_diffusion_lab.quality import corpus


def _perturb(family: str, answer: str) -> str:
    if family in corpus.NUMERIC_FAMILIES:
        number = corpus.final_number(answer)
        return re.sub(r"The answer is -?\d+", f"The answer is {number + 1}", answer)
    last = answer[-1]
    return answer[:-1] + ("1" if last != "1" else "2")


def test_generation_is_deterministic_per_seed():
    first = corpus.generate_examples(300, seed=5)
    assert first == corpus.generate_examples(300, seed=5)
    assert first != corpus.generate_examples(300, seed=6)
    assert {example.family for example in first} == set(corpus.TRAIN_FAMILIES)


@pytest.mark.parametrize("family", corpus.CHECKED_FAMILIES)
def test_answers_score_against_themselves_and_not_perturbations(family):
    for example in corpus.generate_examples(40, seed=11, families=(family,)):
        assert corpus.score(family, example.answer, example.answer)
        assert corpus.score(family, example.answer, f"  {example.answer}\n")
        assert not corpus.score(family, example.answer, _perturb(family, example.answer))
        assert not corpus.score(family, example.answer, "")


def test_numeric_families_compare_the_final_number():
    expected = "3 + 4 = 7\nThe answer is 7."
    assert corpus.score("arithmetic", expected, "3 + 4 = 8\nThe answer is 7.")
    assert not corpus.score("arithmetic", expected, "The answer is 70.")
    assert not corpus.score("count", expected, "7")


def test_eval_prompts_never_appear_in_training():
    train_prompts = {example.prompt for example in corpus.train_examples()}
    held_out = corpus.eval_examples(50)
    assert len(held_out) == 50 * len(corpus.CHECKED_FAMILIES)
    assert len({example.prompt for example in held_out}) == len(held_out)
    assert not train_prompts & {example.prompt for example in held_out}
    assert all(corpus.is_eval_problem(example.family, example.answer) for example in held_out)


def test_mixed_workload_interleaves_the_families():
    mixed = corpus.mixed_eval_examples(10)
    families = corpus.CHECKED_FAMILIES
    assert [e.family for e in mixed] == list(families) + list(families[:3])
    assert set(mixed) <= set(corpus.eval_examples(2))


def test_the_chat_set_is_of_other_kinds_than_the_corpus():
    """The second benchmark workload: distinct prompts, none a corpus prompt or a prompt of
    the corpus's templates, unscored (empty answers), cycled to any count."""
    from vllm_diffusion_lab.quality.chat_set import OTHER_KIND_PROMPTS, chat_examples

    assert len(set(OTHER_KIND_PROMPTS)) == len(OTHER_KIND_PROMPTS) == 64
    corpus_prompts = {e.prompt for e in corpus.train_examples()} | {
        e.prompt for e in corpus.eval_examples(50)}
    assert not corpus_prompts & set(OTHER_KIND_PROMPTS)
    stems = {" ".join(p.split()[:3]) for p in corpus_prompts}
    assert not stems & {" ".join(p.split()[:3]) for p in OTHER_KIND_PROMPTS}
    examples = chat_examples(70)
    assert [e.prompt for e in examples[64:]] == list(OTHER_KIND_PROMPTS[:6])
    assert all(e.answer == "" and e.family == "chat" for e in examples)


def test_unknown_family_and_filler_eval_are_rejected():
    with pytest.raises(ValueError):
        corpus.generate_examples(1, seed=0, families=("poetry",))
    with pytest.raises(ValueError):
        corpus.generate_examples(1, seed=0, families=("filler",), split="eval")


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_diffusion_lab.training.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(corpus.generate_examples(2000, seed=1), vocab_size=600).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_tokenizer_special_tokens_and_chat_template(small_tokenizer):
    tokenizer = small_tokenizer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2, 3]
    assert tokenizer.mask_token == "<|MASK|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "Count from 3 to 5."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nCount from 3 to 5.<|im_end|>\n<|im_start|>assistant\n"
    answered = messages + [{"role": "assistant", "content": "3, 4, 5"}]
    full = tokenizer.apply_chat_template(answered, tokenize=False)
    assert full == text + "3, 4, 5<|im_end|>\n"


def test_tokenizer_round_trips_and_keeps_responses_short(small_tokenizer):
    tokenizer = small_tokenizer
    examples = corpus.generate_examples(300, seed=2)
    for example in examples[:50]:
        text = (f"<|im_start|>user\n{example.prompt}<|im_end|>\n"
                f"<|im_start|>assistant\n{example.answer}<|im_end|>")
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    unseen = "Ünïcode ✓ 123"  # byte-level: any text encodes and decodes back
    assert tokenizer.decode(tokenizer(unseen, add_special_tokens=False)["input_ids"]) == unseen
    lengths = sorted(len(tokenizer(e.answer)["input_ids"]) for e in examples)
    assert lengths[int(0.95 * len(lengths))] < 60


def test_family_weights_reweight_the_training_mix_and_keep_the_split():
    from collections import Counter

    base = Counter(e.family for e in corpus.generate_examples(2000, seed=3))
    heavier = corpus.generate_examples(2000, seed=3, family_weights={"range": 6.0})
    counts = Counter(e.family for e in heavier)
    assert counts["range"] > 2 * base["range"]
    assert not any(corpus.is_eval_problem(e.family, e.answer) for e in heavier
                   if e.family != "filler")
    with pytest.raises(ValueError, match="unknown families"):
        corpus.generate_examples(10, seed=3, family_weights={"poetry": 1.0})


def test_retrieval_problems_plant_the_asked_number():
    from vllm_diffusion_lab.quality.retrieval import retrieval_examples

    for example in retrieval_examples(20, seed=1, filler_words=(40, 200)):
        key = example.prompt.rsplit("secret number of the ", 1)[1].rstrip("?")
        assert f"The secret number of the {key} is {example.answer}." in example.prompt
        assert corpus.is_eval_problem("retrieval", example.answer)
    train = retrieval_examples(20, seed=1, filler_words=(40, 200), split="train")
    assert not any(corpus.is_eval_problem("retrieval", e.answer) for e in train)
    long = retrieval_examples(1, seed=2, filler_words=(1000, 1000))[0]
    assert len(long.prompt.split()) > 1000
