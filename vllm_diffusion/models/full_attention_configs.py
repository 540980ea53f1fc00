"""Hugging Face configuration classes for the full-attention families, LLaDA 1.x and Dream.

- ``LLaDAConfig`` (``model_type: llada``): the fields and defaults of the published
  ``configuration_llada.py`` (its ``ModelConfig``, OLMo-style names: ``d_model``,
  ``n_heads``, ``n_layers``, ...), with the names vLLM reads as aliases or properties.
- ``DreamConfig`` (``model_type: Dream``): Qwen2's configuration with the published
  ``configuration_dream.py`` defaults (``use_cache`` off, ``mask_token_id`` 151666,
  ``pad_token_id`` 151643), and the engine's block size (``block_size``, not a published
  key: the whole canvas, 256).

Both families attend fully (every position to every other) and decode a whole canvas
(LLaDA in semi-autoregressive blocks, Dream as one block);
``FULL_ATTENTION_CAPABILITIES`` declares them (``configs.FAMILY_CAPABILITIES``).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen2Config

from vllm_diffusion.capabilities import ModelCapabilities


class LLaDAConfig(PretrainedConfig):
    """The published LLaDA configuration. Every published field keeps its name and its
    published default (GPT-2-sized, as the published ``ModelConfig``: real checkpoints name
    every field) except the vocabulary and special tokens, whose defaults are
    LLaDA-8B's: ``vocab_size`` / ``embedding_size`` 126464, ``eos_token_id`` /
    ``pad_token_id`` 126081 and ``mask_token_id`` 126336 (``<|mdm_mask|>``, the id
    ``generate.py`` uses; the published default is GPT-2's EOS 50256 for all three ids).

    vLLM's names: ``hidden_size`` (``d_model``), ``num_attention_heads`` (``n_heads``),
    ``num_hidden_layers`` (``n_layers``), ``max_position_embeddings``
    (``max_sequence_length``) and ``tie_word_embeddings`` (``weight_tying``) are aliases;
    ``num_key_value_heads`` (``n_kv_heads``, or 1 / ``n_heads`` as
    ``multi_query_attention`` says where it is None), ``intermediate_size``
    (``mlp_hidden_size`` or ``mlp_ratio * d_model``) and ``head_dim`` (``d_model //
    n_heads``) are derived. ``vocab_size`` is the number of embedding rows the weights
    have, ``embedding_size`` where set (it may exceed the tokenizer's vocabulary, as the
    published model allows); the published ``vocab_size`` stays in ``text_vocab_size``."""

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads",
                     "num_hidden_layers": "n_layers",
                     "max_position_embeddings": "max_sequence_length",
                     "tie_word_embeddings": "weight_tying"}

    def __init__(self, d_model=768, n_heads=12, n_kv_heads=None, n_layers=12, mlp_ratio=4,
                 mlp_hidden_size=None, activation_type="swiglu", block_type="sequential",
                 block_group_size=1, alibi=False, alibi_bias_max=8.0, rope=False,
                 rope_full_precision=True, flash_attention=False, attention_dropout=0.1,
                 multi_query_attention=None, attention_layer_norm=False,
                 residual_dropout=0.1, embedding_dropout=0.1, input_emb_norm=False,
                 layer_norm_type="default", layer_norm_with_affine=True, rms_norm_eps=1e-05,
                 attention_layer_norm_with_affine=True, max_sequence_length=1024,
                 train_max_sequence_length=1024, rope_theta=10000.0, include_qkv_bias=False,
                 include_bias=False, bias_for_layer_norm=None, scale_logits=False,
                 vocab_size=126464, embedding_size=126464, weight_tying=True,
                 eos_token_id=126081, pad_token_id=126081, mask_token_id=126336,
                 init_device=None, init_fn="normal", init_std=0.02, init_cutoff_factor=None,
                 precision=None, use_cache=False, text_vocab_size=None, block_size=32,
                 **kwargs):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size
        self.activation_type = activation_type
        self.block_type = block_type
        self.block_group_size = block_group_size
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.rope = rope
        self.rope_full_precision = rope_full_precision
        self.flash_attention = flash_attention
        self.attention_dropout = attention_dropout
        self.multi_query_attention = multi_query_attention
        self.attention_layer_norm = attention_layer_norm
        self.residual_dropout = residual_dropout
        self.embedding_dropout = embedding_dropout
        self.input_emb_norm = input_emb_norm
        self.layer_norm_type = layer_norm_type
        self.layer_norm_with_affine = layer_norm_with_affine
        self.rms_norm_eps = rms_norm_eps
        self.attention_layer_norm_with_affine = attention_layer_norm_with_affine
        self.max_sequence_length = max_sequence_length
        self.train_max_sequence_length = train_max_sequence_length
        self.rope_theta = rope_theta
        self.include_qkv_bias = include_qkv_bias
        self.include_bias = include_bias
        self.bias_for_layer_norm = bias_for_layer_norm
        self.scale_logits = scale_logits
        # a saved config carries both: the published vocabulary and the embedding rows
        self.text_vocab_size = text_vocab_size if text_vocab_size is not None else vocab_size
        if embedding_size is not None and embedding_size < self.text_vocab_size:
            raise ValueError(f"LLaDA embedding_size ({embedding_size}) must be at least "
                             f"vocab_size ({self.text_vocab_size})")
        self.embedding_size = embedding_size
        self.vocab_size = embedding_size or self.text_vocab_size
        self.mask_token_id = mask_token_id
        # not a published key: the engine's diffusion block (``generate.py``'s
        # ``block_length``, 32 in its examples) unless the checkpoint names one
        self.block_size = block_size
        self.init_device = init_device
        self.init_fn = init_fn
        self.init_std = init_std
        self.init_cutoff_factor = init_cutoff_factor
        self.precision = precision
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["LLaDAModelLM"])
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=weight_tying, **kwargs)

    @property
    def num_key_value_heads(self) -> int:
        """The published ``effective_n_kv_heads``."""
        if self.n_kv_heads is None:
            return 1 if self.multi_query_attention else self.n_heads
        if self.multi_query_attention is not None:
            expected = 1 if self.multi_query_attention else self.n_heads
            if self.n_kv_heads != expected:
                raise ValueError("LLaDA config: multi_query_attention and n_kv_heads "
                                 "disagree")
        return self.n_kv_heads

    @property
    def intermediate_size(self) -> int:
        """The SwiGLU width: ``mlp_hidden_size``, else ``mlp_ratio * d_model``."""
        return self.mlp_hidden_size or self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def unserved_settings(self) -> list[str]:
        """The published settings this package's ``LLaDAModelLM`` does not compute (the
        ones every published LLaDA 1.x checkpoint has are served)."""
        served = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu",
                  "rope": True, "alibi": False, "attention_layer_norm": False,
                  "input_emb_norm": False, "scale_logits": False, "block_group_size": 1,
                  "layer_norm_with_affine": True}
        return [f"{name}={getattr(self, name)!r} (served: {value!r})"
                for name, value in served.items() if getattr(self, name) != value]


class DreamConfig(Qwen2Config):
    """Qwen2's configuration under ``model_type: Dream`` with the published defaults.
    ``mask_token_id`` is read from ``config.json`` (Dream's ``generation_config.json``
    has ``mask_token_id: null``). ``block_size`` is not a published key: the engine's
    diffusion block, which holds the whole canvas (``diffusion_generate`` decodes all
    ``max_new_tokens`` positions as one block), 256 (the engine's default
    ``diffusion_canvas_tokens``, a multiple of it) unless the checkpoint names one."""

    model_type = "Dream"

    def __init__(self, mask_token_id: int | None = 151666, pad_token_id: int | None = 151643,
                 use_cache: bool = False, block_size: int = 256, **kwargs):
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        super().__init__(pad_token_id=pad_token_id, use_cache=use_cache, **kwargs)


def _llada_capabilities(config: Any) -> ModelCapabilities:
    """LLaDA 1.x: full attention, logits predict their own position. Its published decoding
    (``generate.py``: ``low_confidence`` remasking, the top quota of each block's masks by
    the argmax's probability; ``steps`` = ``gen_length`` in its examples, one token per
    step: the engine's ``denoising_steps`` default, the block size; ``block_length`` is
    the configuration's ``block_size``)."""
    return ModelCapabilities(family="LLaDA", attention="full",
                             option_defaults={"strategy": "low_confidence_static"})


def _dream_capabilities(config: Any) -> ModelCapabilities:
    """Dream: full attention, position j's logits come from row j - 1 (its autoregressive
    initialisation), and the whole canvas is one block (``whole_canvas``). Its published
    decoding (``diffusion_generate``): the ``timestep_schedule`` strategy (``steps`` is
    the engine's ``denoising_steps``, ``eps`` 1e-3). Its ``alg`` defaults to ``origin``
    in the published ``DreamGenerationConfig``, which draws random numbers even at
    temperature 0 and is not served; the engine's default is ``maskgit_plus`` (the
    proposal's probability). Dream's README example asks for ``alg="entropy"`` (a
    request option here). Under Fast-dLLM's caches its block loop
    (``generation_utils_block.py``) ranks the schedule's masks by negative entropy
    whatever the ``alg`` (other than its ``confidence_threshold``, the engine's
    ``threshold`` strategy): ``alg`` defaults to ``entropy`` there."""
    return ModelCapabilities(family="Dream", attention="full", shifted_logits=True,
                             whole_canvas=True,
                             option_defaults={"strategy": "timestep_schedule",
                                              "alg": "maskgit_plus"},
                             cached_option_defaults={"alg": "entropy"})


# model_type -> declaration (``configs.FAMILY_CAPABILITIES``)
FULL_ATTENTION_CAPABILITIES = {
    LLaDAConfig.model_type: _llada_capabilities,
    DreamConfig.model_type: _dream_capabilities,
}
