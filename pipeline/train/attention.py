"""Core attention for Megatron-Core's local layer spec over `torch.nn.functional.scaled_dot_product_attention`.

Why: the local spec's `DotProductAttention` materialises the `[b, heads, sq, sk]` scores (baddbmm -> softmax ->
bmm, all kept for backward), which caps the sequence length and is slow; Megatron's fused kernels for it are CUDA
extensions for fp16/bf16 only, and its flash path is Transformer Engine, which does not exist on CPU. SDPA gives
PyTorch's flash / memory-efficient kernels on GPU and its fused flash kernel on CPU, with no extra dependency.

`attention="sdpa"` (the default) swaps `SDPAttention` into the spec's `core_attention`; `attention="local"` keeps
Megatron's module (the reference the tests compare against). Everything else in the layer (fused QKV, RoPE, output
projection, TP) is Megatron's own, so checkpoints and the HF mapping are the same for both.

The contract we implement (megatron-core 0.16.1, `Attention.forward` -> `core_attention(...)`):
- inputs per TP rank: query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` (np query heads over ng groups);
  output `[sq, b, np * hn]`.
- `attention_mask`: None means the layer's mask type decides (causal: SDPA's `is_causal`, which lets the flash
  kernels skip the masked half instead of reading a mask); else a bool tensor broadcastable to `[b, 1, sq, sk]`
  with True = masked out (Megatron's convention, e.g. a block-diagonal causal mask for packed rows), given to SDPA
  inverted (SDPA: True = attend). As in Megatron's unfused path, an explicit mask replaces the causal one. The
  call's `attn_mask_type` wins over the constructor's, as in Transformer Engine's module (Megatron's unfused one
  ignores it; training always passes the layer's own type, so the two agree there).
- softmax scale: `softmax_scale` or 1/sqrt(hn). Megatron's `apply_query_key_layer_scaling` divides the scores by
  the layer number and multiplies them back inside the softmax (an fp16 overflow guard), so the net scale is the same.
- A query row whose keys are all masked: Megatron fills masked scores with -10000 and so averages every key; SDPA
  returns 0 there. Neither is meaningful; block-diagonal causal masks never have such rows (a token sees itself).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

Tensor = torch.Tensor
BACKENDS = ("sdpa", "local")
_TORCH_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


class SDPAttention(MegatronModule):
    """Drop-in `core_attention` for the local spec (same constructor and forward signature as DotProductAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        # Refuse what this module does not implement rather than computing something else.
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attention_dropout": dropout != 0.0,  # Megatron draws it from its TP-aware RNG tracker; we do not
            "context_parallel_size": config.context_parallel_size != 1,
            "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        bad = [name for name, flag in unsupported.items() if flag]
        if bad:
            raise ValueError(f"attention=sdpa does not support {', '.join(bad)} (TransformerConfig); use attention=local")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("attention=sdpa: attention_bias and THD packed_seq_params are not supported "
                             "(pack with a block-diagonal attention_mask instead)")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, hn = query.shape
        groups = key.shape[2]
        # [s, b, n, hn] -> [b, n, s, hn]: views, no copy (the kernels take strided inputs).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask, causal = None, False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool (True = masked out), got {attention_mask.dtype}")
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != key.shape[0]:
                raise ValueError(f"causal attention needs sq == sk, got {sq} and {key.shape[0]}")
            causal = True
        gqa = heads != groups
        if gqa and not _native_gqa(q, mask):
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal, scale=self.softmax_scale,
            **({"enable_gqa": True} if gqa else {}),
        )
        # [b, np, sq, hn] -> [sq, b, np * hn], the layout linear_proj expects.
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def _native_gqa(q: Tensor, mask: Tensor | None) -> bool:
    """Whether SDPA's enable_gqa keeps a fused kernel for these inputs. CPU: its flash kernel takes GQA with or
    without a mask. CUDA: only the flash backend honours enable_gqa (fp16/bf16, no mask); the memory-efficient one
    would fall back to the math path, so there we expand k/v like Megatron does."""
    if not _TORCH_HAS_GQA:
        return False
    if q.device.type == "cpu":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


def layer_spec(attention: str = "sdpa", qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron's local GPT layer spec (RMSNorm; per-head q/k RMSNorm if asked) with the chosen core attention."""
    if attention not in BACKENDS:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(BACKENDS)}")
    # A fresh spec tree per call: safe to edit.
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
