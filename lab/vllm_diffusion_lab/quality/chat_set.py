"""A second benchmark workload: chat prompts of kinds the training corpus does not hold
(open questions, explanations, advice, short writing, definitions, comparisons), none of
them scored. Throughput benchmarks run it next to the evaluation split's prompts so that a
speed figure does not rest on the trained families alone (``--prompt-set chat``)."""

from __future__ import annotations

from vllm_diffusion_lab.quality.corpus import Example

OTHER_KIND_PROMPTS = (
    "Why is the sky blue during the day and red at sunset?",
    "Write a short poem about a lighthouse in winter.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Explain what a hash table is to a new programmer.",
    "Suggest a name for a bakery that sells only bread.",
    "How do plants turn sunlight into food?",
    "Write two sentences that describe a busy train station.",
    "What should I pack for a weekend hiking trip?",
    "Compare cats and dogs as pets in a few lines.",
    "What does the word 'serendipity' mean?",
    "Describe the taste of a lemon to someone who has never had one.",
    "How can I stay focused while studying at home?",
    "Tell me a short story about a robot who learns to paint.",
    "Why do we have leap years?",
    "What are the main parts of a bicycle?",
    "Give a friendly reminder message for a team meeting tomorrow.",
    "Explain why ice floats on water.",
    "What is a good way to start learning to cook?",
    "Write a thank-you note to a neighbour who watered my plants.",
    "How does a rainbow form?",
    "List some fun things to do on a rainy afternoon.",
    "What is the purpose of a museum?",
    "Explain the rules of tic-tac-toe.",
    "Describe a calm morning by a lake.",
    "Why is exercise good for the heart?",
    "What makes a good friend?",
    "Summarise the water cycle in simple words.",
    "Write a haiku about autumn leaves.",
    "How do I politely decline an invitation?",
    "What is the difference between a virus and bacteria?",
    "Give an example of a healthy breakfast.",
    "Why do birds migrate in the winter?",
    "Explain what gravity does in one paragraph.",
    "Write a slogan for a library reading week.",
    "What are the benefits of learning a second language?",
    "Describe the sound of a thunderstorm.",
    "How should I prepare for a job interview?",
    "What is recycling and why does it matter?",
    "Write a short dialogue between a cat and a mouse.",
    "Why do onions make people cry?",
    "Suggest three questions to ask a new classmate.",
    "What happens when water boils?",
    "Describe your ideal weekend in a few sentences.",
    "How do bees make honey?",
    "What is the role of a referee in football?",
    "Write an opening line for a mystery novel.",
    "Explain why the moon changes shape during the month.",
    "What are some ways to save water at home?",
    "Give advice to someone starting their first garden.",
    "Why do we need sleep?",
    "Describe a market square on a Saturday morning.",
    "What is the difference between a lake and a sea?",
    "Write a short apology for arriving late.",
    "How does a compass work?",
    "List the colours of the rainbow and one thing of each colour.",
    "What should a good email subject line do?",
    "Explain what a volcano is.",
    "Write a birthday message for a grandmother.",
    "Why is it colder on top of a mountain?",
    "What is a budget and how do I make one?",
    "Describe the smell of fresh bread.",
    "How can a small town attract visitors?",
    "What is the best way to remember new words?",
)


def chat_examples(n: int) -> list[Example]:
    """``n`` unscored examples (empty answers) cycling through ``OTHER_KIND_PROMPTS``."""
    return [Example("chat", OTHER_KIND_PROMPTS[i % len(OTHER_KIND_PROMPTS)], "")
            for i in range(n)]
