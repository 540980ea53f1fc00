"""Hugging Face configuration classes for the full-attention families (every position
attends to every other): LLaDA 1.x (``model_type: llada``) and Dream (``model_type:
Dream``), and their capabilities (``FULL_ATTENTION_CAPABILITIES``, in
``configs.FAMILY_CAPABILITIES``)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen2Config

from vllm_diffusion.capabilities import ModelCapabilities


class LLaDAConfig(PretrainedConfig):
    """The published ``configuration_llada.py`` (its ``ModelConfig``): every field keeps its
    name and published default (GPT-2-sized) except the vocabulary and special tokens,
    whose defaults are LLaDA-8B's (published: GPT-2's EOS 50256 for all three ids). vLLM's
    names are aliases (``attribute_map``) or derived (properties below); ``vocab_size`` is
    the embedding rows, ``embedding_size`` where set (it may exceed the tokenizer's
    vocabulary), the published ``vocab_size`` staying in ``text_vocab_size``."""

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
        # every published field keeps its name; ``block_size`` is not a published key: the
        # engine's diffusion block (``generate.py``'s ``block_length``, 32 in its examples)
        # unless the checkpoint names one
        given = locals()
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_ratio",
                     "mlp_hidden_size", "activation_type", "block_type", "block_group_size",
                     "alibi", "alibi_bias_max", "rope", "rope_full_precision",
                     "flash_attention", "attention_dropout", "multi_query_attention",
                     "attention_layer_norm", "residual_dropout", "embedding_dropout",
                     "input_emb_norm", "layer_norm_type", "layer_norm_with_affine",
                     "rms_norm_eps", "attention_layer_norm_with_affine", "max_sequence_length",
                     "train_max_sequence_length", "rope_theta", "include_qkv_bias",
                     "include_bias", "bias_for_layer_norm", "scale_logits", "mask_token_id",
                     "block_size", "init_device", "init_fn", "init_std", "init_cutoff_factor",
                     "precision", "use_cache"):
            setattr(self, name, given[name])
        # a saved config carries both: the published vocabulary and the embedding rows
        self.text_vocab_size = text_vocab_size if text_vocab_size is not None else vocab_size
        if embedding_size is not None and embedding_size < self.text_vocab_size:
            raise ValueError(f"LLaDA embedding_size ({embedding_size}) must be at least "
                             f"vocab_size ({self.text_vocab_size})")
        self.embedding_size = embedding_size
        self.vocab_size = embedding_size or self.text_vocab_size
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
    """Qwen2's configuration with the published ``configuration_dream.py`` defaults;
    ``mask_token_id`` is read from ``config.json`` (Dream's ``generation_config.json`` has
    ``mask_token_id: null``). ``block_size`` is not a published key: the engine's block,
    the whole canvas, 256 (the default ``diffusion_canvas_tokens``) unless named."""

    model_type = "Dream"

    def __init__(self, mask_token_id: int | None = 151666, pad_token_id: int | None = 151643,
                 use_cache: bool = False, block_size: int = 256, **kwargs):
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        super().__init__(pad_token_id=pad_token_id, use_cache=use_cache, **kwargs)


def _llada_capabilities(config: Any) -> ModelCapabilities:
    """LLaDA 1.x: full attention, logits predict their own position; decoded as
    ``generate.py`` (docs/models.md, "LLaDA 1.x")."""
    return ModelCapabilities(family="LLaDA", attention="full",
                             option_defaults={"strategy": "low_confidence_static"})


def _dream_capabilities(config: Any) -> ModelCapabilities:
    """Dream: full attention, position j's logits from row j - 1, the whole canvas one
    block, decoded as ``diffusion_generate``. ``alg``: not the published default
    ``origin`` (random even at temperature 0, not served) but ``maskgit_plus``, and
    ``entropy`` under Fast-dLLM's caches, as its block loop ranks (docs/models.md,
    "Dream")."""
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
