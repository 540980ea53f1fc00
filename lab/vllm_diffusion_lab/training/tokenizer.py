"""The byte-level BPE chat tokenizer of the embedded SDAR models, trained on the task corpus.

Special tokens (ids 0..3): ``<|endoftext|>`` (pad, and the filler the model
writes after the answer inside its last block), ``<|im_start|>``,
``<|im_end|>`` (end of the assistant turn: the tokenizer's eos token) and
``<|MASK|>`` (the diffusion mask token). Numbers are split into single
digits, as in Qwen, so that arithmetic is learnable digit by digit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vllm_diffusion_lab.quality.corpus import Example

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
DEFAULT_VOCAB_SIZE = 1024

# ChatML; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace (the split used by Qwen2/GPT-4 style BPE).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _training_texts(examples: Iterable[Example]) -> Iterator[str]:
    # Special tokens are registered separately, so only the plain text is fed to BPE.
    for example in examples:
        yield f"user\n{example.prompt}\n"
        yield f"assistant\n{example.answer}\n"


def build_tokenizer(examples: Iterable[Example],
                    vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train BPE on ``examples`` and wrap it with the chat template and special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(examples), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        extra_special_tokens=[IM_START],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
