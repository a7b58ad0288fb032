"""What our decoder needs to know about a target, read off a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ModelLoadError

# model_type -> family. One decoder serves all of them; the family only switches a few flags.
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass
class DecoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str = "silu"
    qk_norm: bool = False            # Qwen3, Gemma 3: RMSNorm over each head before RoPE
    sandwich_norm: bool = False      # Gemma 3: norms before and after attention and MLP
    norm_offset: bool = False        # Gemma 3: RMSNorm scales by (1 + w)
    embed_scale: float = 1.0         # Gemma 3: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None = head_dim ** -0.5
    final_logit_softcap: float | None = None
    sliding_windows: list = field(default_factory=list)  # per layer: None or window length
    eos_token_ids: tuple = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config) -> DecoderConfig:
        hf_config = getattr(hf_config, "text_config", None) or hf_config
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in FAMILIES:
            raise ModelLoadError(
                f"unsupported model type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
        family = FAMILIES[model_type]
        act_name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        if act_name not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act_name!r}")
        if getattr(hf_config, "attn_logit_softcapping", None):
            raise ModelLoadError("attention logit soft-capping is not supported")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = hf_config.eos_token_id if hasattr(hf_config, "eos_token_id") else None
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        gemma = family == "gemma3"
        scalar = getattr(hf_config, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            family=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            activation=_ACTIVATIONS[act_name],
            qk_norm=family in ("qwen3", "gemma3"),
            sandwich_norm=gemma,
            norm_offset=gemma,
            embed_scale=hf_config.hidden_size ** 0.5 if gemma else 1.0,
            attn_scale=scalar ** -0.5 if scalar else None,
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            eos_token_ids=eos,
        )
