"""ModelSpec: a transformer's architecture as the advisor needs it, from a preset
(``strategies/advise/models.json``), a Hugging Face ``config.json``, or a parameter count.

Parameter counts are exact for the two families (see the presets file): every weight
matrix, bias and norm scale, the embedding and an untied head; multi-head latent attention
and shared/routed experts for DeepSeek.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

from jaxdist import errors

DIRECTORY = Path(__file__).resolve().parents[2] / "strategies" / "advise"
FAMILIES = ("gpt", "llama")


@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict[str, Any]:
  """A presets file, read once per process (callers must not mutate it)."""
  with open(DIRECTORY / name) as f:
    return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def presets() -> list[str]:
  """Names accepted by :meth:`ModelSpec.from_preset`."""
  return sorted(_load("models.json"))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only transformer (dense or mixture-of-experts).

  ``ffn_hidden_size`` is the dense MLP's inner width (4·h for ``gpt``);
  ``moe_ffn_hidden_size`` each expert's (default ``ffn_hidden_size``). MoE layers are the
  layers after ``first_dense_layers``. ``params_override`` fixes ``num_params`` (a model
  given by its count, :meth:`from_params`); the architecture then only shapes activations
  and flops.
  """

  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int | None = None
  ffn_hidden_size: int | None = None
  vocab_size: int = 51200
  num_experts: int = 1
  experts_per_token: int = 1
  seq_len: int = 2048
  family: str = "gpt"
  name: str = "custom"
  head_dim: int | None = None
  qkv_bias: bool = False
  tied_embeddings: bool | None = None
  dropout: bool | None = None
  moe_ffn_hidden_size: int | None = None
  num_shared_experts: int = 0
  first_dense_layers: int = 0
  q_lora_rank: int | None = None
  kv_lora_rank: int | None = None
  qk_nope_head_dim: int | None = None
  qk_rope_head_dim: int | None = None
  v_head_dim: int | None = None
  published_params: float | None = None
  published_active_params: float | None = None
  params_override: float | None = None
  source: str | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise errors.InvalidArgumentError(
          f"ModelSpec(family={self.family!r}) is not a known family; valid: {FAMILIES}.")
    for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len",
                  "num_experts", "experts_per_token"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            f"ModelSpec({field}={value!r}) must be a positive integer.")
    if self.experts_per_token > self.num_experts:
      raise errors.InvalidArgumentError(
          f"ModelSpec(experts_per_token={self.experts_per_token}) exceeds num_experts="
          f"{self.num_experts}.")
    gpt = self.family == "gpt"
    # Without head_dim the attention is hidden_size wide (GPT-3's table lists 24 heads of
    # 128 for the 1.3B model, but its parameter count is that of width 2048).
    width = self.hidden_size if self.head_dim is None else self.num_heads * self.head_dim
    object.__setattr__(self, "_attention_width", width)
    defaults = {"num_kv_heads": self.num_heads,
                "ffn_hidden_size": 4 * self.hidden_size,
                "head_dim": self.hidden_size // self.num_heads,
                "tied_embeddings": gpt,
                "dropout": gpt}
    for field, value in defaults.items():
      if getattr(self, field) is None:
        object.__setattr__(self, field, value)
    if self.moe_ffn_hidden_size is None:
      object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
    if self.num_heads % self.num_kv_heads:
      raise errors.InvalidArgumentError(
          f"ModelSpec(num_kv_heads={self.num_kv_heads}) must divide num_heads={self.num_heads}.")

  presets = staticmethod(presets)

  # ---- constructors -------------------------------------------------------------------

  @classmethod
  def from_preset(cls, name: str, **overrides) -> "ModelSpec":
    """A preset by name (:func:`presets`), e.g. ``"llama-3.1-70b"``; keyword arguments
    override its fields (``seq_len=8192``)."""
    table = _load("models.json")
    key = name.lower()
    if key not in table:
      raise errors.InvalidArgumentError(
          f"ModelSpec.from_preset(name={name!r}) is not a preset; valid: {', '.join(sorted(table))}.")
    return cls(name=key, **{**table[key], **overrides})

  @classmethod
  def from_hf_config(cls, config: str | Path | dict, **overrides) -> "ModelSpec":
    """From a Hugging Face ``config.json`` (path or dict) of the Llama, Mistral/Mixtral,
    Qwen2, DeepSeek-V2/V3 or GPT-2 families. ``seq_len`` defaults to the context length
    capped at 8192 (the training length, not the extended one); override it."""
    if not isinstance(config, dict):
      with open(config) as f:
        config = json.load(f)
    kind = str(config.get("model_type", "")).lower()
    g = config.get
    if kind == "gpt2":
      fields = dict(family="gpt", num_layers=g("n_layer"), hidden_size=g("n_embd"),
                    num_heads=g("n_head"), ffn_hidden_size=g("n_inner") or 4 * g("n_embd"),
                    vocab_size=g("vocab_size"), seq_len=g("n_positions", 1024))
    elif kind in ("llama", "mistral", "mixtral", "qwen2", "deepseek_v2", "deepseek_v3"):
      experts = g("num_local_experts") or g("n_routed_experts") or 1
      fields = dict(family="llama", num_layers=g("num_hidden_layers"),
                    hidden_size=g("hidden_size"), num_heads=g("num_attention_heads"),
                    num_kv_heads=g("num_key_value_heads") or g("num_attention_heads"),
                    ffn_hidden_size=g("intermediate_size"), vocab_size=g("vocab_size"),
                    seq_len=min(g("max_position_embeddings") or 4096, 8192),
                    head_dim=g("head_dim"), tied_embeddings=bool(g("tie_word_embeddings", False)),
                    qkv_bias=bool(g("attention_bias", kind == "qwen2")),
                    num_experts=experts,
                    experts_per_token=(g("num_experts_per_tok") or 1) if experts > 1 else 1)
      if kind.startswith("deepseek"):
        fields.update(moe_ffn_hidden_size=g("moe_intermediate_size"),
                      num_shared_experts=g("n_shared_experts") or 0,
                      first_dense_layers=g("first_k_dense_replace") or 0,
                      q_lora_rank=g("q_lora_rank"), kv_lora_rank=g("kv_lora_rank"),
                      qk_nope_head_dim=g("qk_nope_head_dim"),
                      qk_rope_head_dim=g("qk_rope_head_dim"), v_head_dim=g("v_head_dim"),
                      head_dim=None)
    else:
      raise errors.InvalidArgumentError(
          f"ModelSpec.from_hf_config: model_type={kind!r} is not supported; valid: gpt2, llama, "
          f"mistral, mixtral, qwen2, deepseek_v2, deepseek_v3.")
    missing = [k for k, v in fields.items()
               if v is None and k not in ("head_dim", "q_lora_rank")]
    if missing:
      raise errors.InvalidArgumentError(
          f"ModelSpec.from_hf_config: the config lacks {', '.join(missing)} for model_type {kind!r}.")
    name = str(g("_name_or_path") or g("name_or_path") or kind)
    return cls(name=name, **{k: v for k, v in {**fields, **overrides}.items() if v is not None})

  @classmethod
  def from_params(cls, billions: float, *, seq_len: int = 2048, vocab_size: int = 51200,
                  num_layers: int | None = None, hidden_size: int | None = None,
                  num_heads: int | None = None) -> "ModelSpec":
    """A GPT-shaped model of ``billions`` parameters (``num_params`` is exactly that). The
    shape, unless given, follows the Megatron-LM scaling table: hidden size from
    ``N ≈ 12·L·h²`` with ``L ≈ h / 96`` (rounded to multiples of 128), heads of size 128."""
    if not billions > 0:
      raise errors.InvalidArgumentError(
          f"ModelSpec.from_params(billions={billions!r}) must be positive.")
    n = billions * 1e9
    if hidden_size is None:
      h = (n * 96 / 12) ** (1 / 3) if num_layers is None else math.sqrt(n / (12 * num_layers))
      hidden_size = max(128, int(round(h / 128)) * 128)
    if num_layers is None:
      num_layers = max(1, int(round(n / (12 * hidden_size ** 2))))
    if num_heads is None:
      num_heads = max(1, hidden_size // 128)
    return cls(name=f"{billions:g}B", num_layers=num_layers, hidden_size=hidden_size,
               num_heads=num_heads, vocab_size=vocab_size, seq_len=seq_len, params_override=n)

  # ---- derived sizes ------------------------------------------------------------------

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 1

  @property
  def mla(self) -> bool:
    return self.kv_lora_rank is not None

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.first_dense_layers if self.is_moe else 0

  @property
  def dense_layers(self) -> int:
    return self.num_layers - self.moe_layers

  @property
  def q_dim(self) -> int:
    """Width of the queries (and keys, without grouped-query sharing)."""
    if self.mla:
      return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
    return self._attention_width

  @property
  def kv_dim(self) -> int:
    """Width of the keys (= values) actually materialized per token."""
    if self.mla:
      return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
    return self._attention_width * self.num_kv_heads // self.num_heads

  @property
  def v_dim(self) -> int:
    return self.num_heads * self.v_head_dim if self.mla else self._attention_width

  def attention_params(self) -> int:
    h, gpt = self.hidden_size, self.family == "gpt"
    if self.mla:
      nope, rope, vh = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
      heads, kv_rank = self.num_heads, self.kv_lora_rank
      if self.q_lora_rank:
        q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * (nope + rope)
      else:
        q = h * heads * (nope + rope)
      kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + vh)
      return q + kv + heads * vh * h
    qkv = h * (self.q_dim + 2 * self.kv_dim)
    bias = (self.q_dim + 2 * self.kv_dim) if (gpt or self.qkv_bias) else 0
    out = self.v_dim * h + (h if gpt else 0)
    return qkv + bias + out

  def mlp_params(self, ffn: int) -> int:
    h = self.hidden_size
    if self.family == "gpt":
      return 2 * h * ffn + ffn + h
    return 3 * h * ffn

  def norm_params_per_layer(self) -> int:
    return (4 if self.family == "gpt" else 2) * self.hidden_size

  def expert_params_per_layer(self) -> int:
    """Routed experts of one MoE layer."""
    return self.num_experts * self.mlp_params(self.moe_ffn_hidden_size)

  def dense_params_per_moe_layer(self) -> int:
    """What every device of a tensor-parallel group holds of an MoE layer besides the
    routed experts: attention, shared experts, router, norms."""
    return (self.attention_params() + self.num_shared_experts * self.mlp_params(self.moe_ffn_hidden_size)
            + self.num_experts * self.hidden_size + self.norm_params_per_layer())

  def dense_layer_params(self) -> int:
    return (self.attention_params() + self.mlp_params(self.ffn_hidden_size)
            + self.norm_params_per_layer())

  def embedding_params(self) -> int:
    positions = self.seq_len if self.family == "gpt" else 0
    return (self.vocab_size + positions) * self.hidden_size

  def head_params(self) -> int:
    """The output layer (0 when tied to the embedding) and the final norm."""
    final_norm = (2 if self.family == "gpt" else 1) * self.hidden_size
    return (0 if self.tied_embeddings else self.vocab_size * self.hidden_size) + final_norm

  @property
  def num_params(self) -> float:
    """Every parameter (all experts)."""
    if self.params_override is not None:
      return float(self.params_override)
    return float(self.dense_layers * self.dense_layer_params()
                 + self.moe_layers * (self.dense_params_per_moe_layer()
                                      + self.expert_params_per_layer())
                 + self.embedding_params() + self.head_params())

  @property
  def active_params(self) -> float:
    """Parameters one token passes through (``experts_per_token`` routed experts)."""
    routed = self.moe_layers * (self.num_experts - self.experts_per_token) * self.mlp_params(
        self.moe_ffn_hidden_size)
    return self.num_params - routed

  def forward_flops_per_token(self, *, causal: bool = False) -> dict[str, float]:
    """Forward flops of one token: ``layers`` (matmuls through active weights),
    ``attention`` (scores and weighted values over ``seq_len`` keys; the full square as
    Megatron-LM counts it unless ``causal``), ``logits``."""
    h, s = self.hidden_size, self.seq_len
    layer_weights = (self.dense_layers * (self.dense_layer_params() - self.norm_params_per_layer())
                     + self.moe_layers * (self.dense_params_per_moe_layer()
                                          - self.norm_params_per_layer()
                                          + self.experts_per_token
                                          * self.mlp_params(self.moe_ffn_hidden_size)))
    if self.params_override is not None:
      layer_weights = self.num_params - self.embedding_params() - self.head_params()
    attention = 2 * s * (self.q_dim + self.v_dim) * self.num_layers * (0.5 if causal else 1.0)
    return {"layers": 2.0 * layer_weights, "attention": float(attention),
            "logits": 2.0 * h * self.vocab_size}

  def summary(self) -> dict[str, Any]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if getattr(self, f.name) is not None}
    out["num_params"] = self.num_params
    if self.is_moe:
      out["active_params"] = self.active_params
    return out
