"""Training prompts for the conversion of SmolLM2-135M-Instruct, written from templates of
many kinds (advice, explanations, short writing, lists, summaries, arithmetic, formats,
definitions, comparisons), plus the first lines of two conversation corpora that ship in
packages when they are installed: ``chatterbot-corpus`` 1.3.3 (BSD-3-Clause; its English
questions) and ``chitchat-dataset`` 0.9.0 (MIT; the opening messages of its
conversations). The original model's own greedy answers to them are the training targets
(``tools/distill_smollm2.py``). Evaluation and benchmark prompts are kept out: every prompt
equal to one of them (after case and space folding) is dropped here."""

from __future__ import annotations

import random

TOPICS = (
    "the ocean", "volcanoes", "honey bees", "the moon", "trains", "coffee", "rain forests",
    "chess", "the internet", "bicycles", "deserts", "whales", "electricity", "music",
    "gardening", "the Roman Empire", "clouds", "recycling", "photography", "airplanes",
    "libraries", "penguins", "glaciers", "soap", "bread", "friendship", "maps", "robots",
    "the heart", "earthquakes", "solar panels", "mushrooms", "kites", "bridges", "owls",
    "the stock market", "vaccines", "tea", "rivers", "wind turbines", "dinosaurs", "ants",
    "snow", "the printing press", "money", "football", "yoga", "batteries", "telescopes",
    "lightning", "the alphabet", "computers", "forests", "cheese", "fireworks", "sharks",
    "mountains", "newspapers", "time zones", "magnets", "spiders", "rainbows", "islands",
    "castles", "pizza", "memory", "dreams", "cities", "farming", "the calendar", "sleep",
)
SKILLS = (
    "learn a new language", "save money each month", "keep my desk tidy", "make new friends",
    "get better at public speaking", "drink more water", "start running", "read more books",
    "cook healthy meals", "manage stress at work", "wake up earlier", "learn to draw",
    "write a good resume", "prepare for a job interview", "keep a houseplant alive",
    "spend less time on my phone", "learn to play guitar", "organize my week",
    "be more patient", "take better photos", "keep my room clean", "remember names",
    "study for an exam", "travel on a budget", "stay motivated", "learn to swim",
    "write clearer emails", "plan a birthday party", "train my dog", "eat less sugar",
)
THINGS = (
    "a cat", "a spoon", "a violin", "a raincoat", "a candle", "a volcano", "a lighthouse",
    "a market", "a library", "a dragon", "a snowman", "a garden", "a clock", "a river",
    "a tiny robot", "an old key", "a paper boat", "a fox", "a sunflower", "a train ride",
    "a storm", "a kitchen", "a city at night", "a mountain village", "a lost balloon",
)
WORDS = (
    "curious", "gentle", "ancient", "brave", "fragile", "generous", "humble", "vivid",
    "reluctant", "eager", "obscure", "sturdy", "swift", "tranquil", "bold", "clumsy",
    "diligent", "fierce", "loyal", "nimble", "peculiar", "quaint", "rapid", "sincere",
    "tedious", "vast", "wary", "zealous", "candid", "frugal",
)
PAIRS = (
    ("tea", "coffee"), ("trains", "buses"), ("books", "films"), ("summer", "winter"),
    ("cities", "villages"), ("email", "letters"), ("walking", "cycling"),
    ("laptops", "tablets"), ("rivers", "lakes"), ("piano", "guitar"), ("apples", "oranges"),
    ("stars", "planets"), ("frogs", "toads"), ("oceans", "seas"), ("jogging", "swimming"),
)
NAMES = ("Anna", "Ben", "Carla", "David", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Kira", "Leo", "Maya", "Nils", "Olga", "Pablo", "Rosa", "Sami", "Tara", "Umar")
ITEMS = ("apples", "pencils", "books", "marbles", "stickers", "cookies", "coins", "cards",
         "stamps", "shells")


def _advice(rng):
    return rng.choice(("How can I {s}?", "What is the best way to {s}?",
                       "Any tips to {s}?", "I want to {s}. Where should I start?",
                       "Give me some advice: I need to {s}.")).format(s=rng.choice(SKILLS))


def _explain(rng):
    return rng.choice(("Explain {t} in simple terms.", "Tell me something interesting about "
                       "{t}.", "What should a child know about {t}?",
                       "Give a short explanation of {t}.", "Why are people interested in {t}?",
                       "What is the history of {t} in a few sentences?")
                      ).format(t=rng.choice(TOPICS))


def _writing(rng):
    return rng.choice(("Write a short poem about {x}.", "Write a short story about {x}.",
                       "Describe {x} in three sentences.", "Write a limerick about {x}.",
                       "Write a short email inviting {n} to see {x} with me.",
                       "Write a diary entry from the point of view of {x}.")
                      ).format(x=rng.choice(THINGS), n=rng.choice(NAMES))


def _lists(rng):
    return rng.choice(("List five facts about {t}.", "Name three things related to {t}.",
                       "Give me a list of four questions about {t}.",
                       "What are some good books or ideas about {t}? List a few.",
                       "List the steps to {s}.")
                      ).format(t=rng.choice(TOPICS), s=rng.choice(SKILLS))


def _summary(rng):
    a, b = rng.sample(TOPICS, 2)
    n = rng.choice(NAMES)
    text = (f"{n} spent the weekend reading about {a}. On Saturday {n} visited a museum "
            f"with an exhibit on {b}, and on Sunday wrote notes comparing the two.")
    return rng.choice(("Summarize this in one sentence: {p}", "What is the main idea here? "
                       "{p}", "Shorten this text: {p}")).format(p=text)


def _arithmetic(rng):
    n = rng.choice(NAMES)
    a, b = rng.randint(2, 30), rng.randint(2, 20)
    item = rng.choice(ITEMS)
    return rng.choice((f"{n} has {a} {item} and buys {b} more. How many {item} now?",
                       f"{n} had {a + b} {item} and gave away {b}. How many are left?",
                       f"What is {a} times {b}?", f"Compute {a} + {b} - {min(a, b)}.",
                       f"If one box holds {b} {item}, how many are in {a} boxes?"))


def _formats(rng):
    n, m = rng.sample(NAMES, 2)
    return rng.choice((f"Write a JSON object with the names {n} and {m} and their ages.",
                       f"Turn this into a bullet list: {rng.choice(TOPICS)}, "
                       f"{rng.choice(TOPICS)}, {rng.choice(TOPICS)}.",
                       f"Write a table of three {rng.choice(ITEMS)} and their colours.",
                       f"Reply in one word: is {rng.choice(TOPICS)} interesting?",
                       f"Write the word {rng.choice(WORDS)} in capital letters."))


def _definition(rng):
    return rng.choice(("What does the word '{w}' mean?", "Use '{w}' in a sentence.",
                       "Give a synonym for '{w}'.", "Define {w}.")
                      ).format(w=rng.choice(WORDS))


def _compare(rng):
    a, b = rng.choice(PAIRS)
    return rng.choice((f"Compare {a} and {b}.", f"Which is better, {a} or {b}? Why?",
                       f"What do {a} and {b} have in common?"))


KINDS = (_advice, _explain, _writing, _lists, _summary, _arithmetic, _formats, _definition,
         _compare)


def corpus_prompts() -> list[str]:
    """Questions from the conversation corpora that are installed (none if neither is)."""
    prompts: list[str] = []
    try:
        import importlib.util
        import pathlib

        import yaml
        spec = importlib.util.find_spec("chatterbot_corpus")
        if spec and spec.submodule_search_locations:
            root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "data" / "english"
            for path in sorted(root.glob("*.yml")):
                for conversation in yaml.safe_load(path.read_text()).get("conversations", []):
                    if conversation and isinstance(conversation[0], str):
                        prompts.append(conversation[0].strip())
    except ImportError:
        pass
    try:
        import json
        import importlib.util
        import pathlib
        spec = importlib.util.find_spec("chitchat_dataset")
        if spec and spec.submodule_search_locations:
            data = json.loads((pathlib.Path(list(spec.submodule_search_locations)[0])
                               / "dataset.json").read_text())
            for conversation in data.values():
                for message in conversation["messages"][:1]:
                    text = " ".join(turn["text"] for turn in message).strip()
                    if text.endswith("?") and 15 <= len(text) <= 200:
                        prompts.append(text)
    except ImportError:
        pass
    return prompts


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def training_prompts(count: int, seed: int = 0, excluded: list[str] = (),
                     corpus_fraction: float = 0.3) -> list[str]:
    """``count`` distinct prompts: templates of every kind and, for ``corpus_fraction`` of
    them, corpus questions; none equal (folded) to an ``excluded`` prompt."""
    rng = random.Random(seed)
    banned = {_fold(p) for p in excluded}
    seen: set[str] = set()
    out: list[str] = []
    corpus = [p for p in corpus_prompts() if _fold(p) not in banned]
    rng.shuffle(corpus)
    for prompt in corpus[:int(count * corpus_fraction)]:
        if _fold(prompt) not in seen:
            seen.add(_fold(prompt))
            out.append(prompt)
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        prompt = rng.choice(KINDS)(rng)
        if _fold(prompt) in seen or _fold(prompt) in banned:
            continue
        seen.add(_fold(prompt))
        out.append(prompt)
    rng.shuffle(out)
    return out
