"""HF Llama / Mistral / Qwen2 / Qwen3 checkpoint <-> Megatron-Core GPTModel (local layer spec, fp32), for the student
trainer. Which configs are accepted, and the refusals: `pipeline.train.models.families`.

Why our own mapping: the bridge packages (megatron-bridge, mcore-bridge) need Transformer Engine, which does not
exist on CPU, and for these architectures the mapping is a handful of reshapes (docs/dependencies.md, "Megatron-Core
on CPU"). Export writes a plain HF folder (safetensors + config.json + the source's tokenizer files) that
transformers and vLLM load, which is how the on-policy loop hands student weights to the sampler.

Layout facts the mapping relies on (megatron-core 0.16.1):
- linear_qkv rows are grouped per query group g: [q heads of g | k_g | v_g], and TP splits rows contiguously,
  so TP rank r owns query groups [r*G/tp, (r+1)*G/tp).
- linear_fc1 on TP rank r is cat(gate_r, up_r) of that rank's row slices (SwiGLU chunks the local output in two).
- linear_proj and linear_fc2 are row-parallel (split along the input dim); embedding and output layer are
  vocab-parallel (split along rows). Norms are replicated.
- Qwen3's q_norm/k_norm are `self_attention.q_layernorm/k_layernorm` (RMSNorm over head_dim, eps = layernorm_epsilon
  = rms_norm_eps, applied per head before RoPE, as in transformers); replicated under TP, and their gradients are
  summed over TP ranks by finalize_model_grads because TransformerConfig.qk_layernorm is set.

Vocab padding: Megatron needs vocab % tp == 0. `build_model` pads the vocab to a multiple of
`pad_vocab_to_multiple_of` (default: tp) with zero rows; padded ids then get logit exactly 0, so the loss
must ignore columns >= `model.hf_vocab_size` (the original vocab). Export strips the padding.

    python -c "from pipeline.train.models.megatron import *"   # exercised by tests/train/models/test_model.py
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import MissingInputError
from pipeline.store.shards import staged_dir
from pipeline.train.models.attention import layer_spec
from pipeline.train.models.families import HFArch, check_trainable, llama3_inv_freq, read_hf_arch
from pipeline.train.models.layers import layer_key, layer_offset
from pipeline.train.models.lora import merge_into, to_peft, write_peft_folder
from pipeline.train.models.recompute import keep_inputs_differentiable, recompute_options

__all__ = ["HFArch", "ModelChunks", "build_chunks", "build_model", "check_trainable", "export_adapter", "export_hf", "gather_shards",
           "hf_to_megatron_state_dict", "load_hf_weights", "megatron_to_hf_state_dict", "padded_vocab", "read_hf_arch",
           "read_hf_state_dict"]

Tensor = torch.Tensor
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$")


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= vocab_size."""
    return -(-vocab_size // multiple) * multiple


def build_model(hf_dir: str | Path, pad_vocab_to_multiple_of: int | None = None, *,
                params_dtype: torch.dtype = torch.float32, attention: str = "sdpa", recompute: str = "none",
                vp_stage: int | None = None) -> GPTModel:
    """Build an (uninitialised-weights) GPTModel matching the HF config, for this rank's TP/PP slice.

    `params_dtype=torch.bfloat16` builds it for bf16 mixed precision (the trainer wraps it in Megatron's
    Float16Module and keeps fp32 main weights in the optimizer). `attention`: "sdpa" (torch's fused kernels) or
    "local" (Megatron's unfused DotProductAttention), see attention.py; `recompute`: "none", "selective" or "full"
    activation recompute, see recompute.py. `vp_stage`: under interleaved pipelining (Megatron's virtual pipeline
    size set by `init_distributed(vpp=V)`), which of this rank's V model chunks to build (`build_chunks`). Needs `init_distributed` first. Sets `model.hf_arch` and
    `model.hf_vocab_size` for the loader/exporter/loss.
    """
    layer_spec(attention)  # bad names fail before any work
    recompute_kw = recompute_options(recompute)
    arch = read_hf_arch(hf_dir)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,  # also makes finalize_model_grads sum q/k norm grads over TP ranks
        rotary_interleaved=False,  # transformers' rotate_half layout
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        # attention=sdpa gathers K/V over the CP ranks (context_parallel.py); Megatron's RoPE picks their chunks
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=params_dtype,  # required by TransformerConfig when pp > 1 (p2p buffer dtype)
        use_cpu_initialization=not torch.cuda.is_available(),
        **recompute_kw,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(attention, qk_layernorm=arch.qk_norm),
        vocab_size=padded_vocab(arch.vocab_size, pad_vocab_to_multiple_of or tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=1.0,  # partial_rotary_factor != 1 is refused by read_hf_arch
        rope_scaling=False,  # llama3 scaling is applied below with the config's own parameters
        vp_stage=vp_stage,
    )
    if arch.rope_scaling is not None:
        rope = model.rotary_pos_emb
        # A plain attribute, not a buffer: not in checkpoints, so it is set here on every build (before any forward:
        # RotaryEmbedding.forward is lru-cached).
        rope.inv_freq = llama3_inv_freq(rope.inv_freq, arch.rope_scaling)
    if recompute == "full":
        keep_inputs_differentiable(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.hf_arch = arch
    model.hf_vocab_size = arch.vocab_size
    return model


class ModelChunks(list):
    """This pipeline rank's V model chunks under interleaved 1F1B (virtual_pipeline_model_parallel_size=V), in
    virtual-stage order: chunk v holds global layers [(v·P + rank)·L, (v·P + rank + 1)·L), L = layers / (P·V); the
    embedding is chunk 0's of rank 0, the output layer chunk V-1's of the last rank. Megatron-Core's interleaved
    schedule, finalize_model_grads and optimizer take the list; the trainer reads the student's facts off it as off
    one model."""

    hf_arch = property(lambda self: self[0].hf_arch)
    hf_vocab_size = property(lambda self: self[0].hf_vocab_size)
    config = property(lambda self: self[0].config)
    post_process = property(lambda self: self[-1].post_process)

    def parameters(self):
        return (p for chunk in self for p in chunk.parameters())


def build_chunks(hf_dir: str | Path, vpp: int, **kw) -> ModelChunks:
    """`vpp` chunks of `build_model(hf_dir, vp_stage=v, **kw)`, each with its HF weights loaded."""
    chunks = ModelChunks(build_model(hf_dir, vp_stage=v, **kw) for v in range(vpp))
    for chunk in chunks:
        load_hf_weights(chunk, hf_dir)
    return chunks


# ---------------------------------------------------------------- pure state-dict mappings (global layer ids)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megatron_state_dict(
    hf: dict[str, Tensor], arch: HFArch, tp_rank: int = 0, tp_size: int = 1, padded_vocab_size: int | None = None,
    layers: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """HF tensors -> the Megatron state dict of one TP rank, keyed by global layer index: the layers `layers` (None:
    all), and the embedding, final norm and output layer where `hf` holds them (a pipeline stage reads only its own)."""
    heads_per_group, groups, d = arch.num_heads // arch.num_kv_heads, arch.num_kv_heads, arch.head_dim
    if groups % tp_size or arch.ffn_hidden_size % tp_size:
        raise ValueError(f"tp={tp_size} must divide num_key_value_heads={groups} and intermediate_size")
    rows = padded_vocab_size or arch.vocab_size

    def shard(t: Tensor, dim: int) -> Tensor:
        return t.chunk(tp_size, dim=dim)[tp_rank].clone()

    def qkv(prefix: str, suffix: str) -> Tensor:
        q, k, v = (hf[f"{prefix}self_attn.{n}_proj.{suffix}"] for n in "qkv")
        rest = q.shape[1:]  # (hidden,) for weights, () for biases
        fused = torch.cat(
            [q.reshape(groups, heads_per_group * d, -1), k.reshape(groups, d, -1), v.reshape(groups, d, -1)], dim=1
        )  # [G, (hpg + 2) * d, in]: Megatron's per-query-group order
        return shard(fused, 0).reshape(-1, *rest)

    out = {}
    if "model.embed_tokens.weight" in hf:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(hf["model.embed_tokens.weight"], rows), 0)
    for i in range(arch.num_layers) if layers is None else layers:
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = qkv(p, "weight")
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = qkv(p, "bias")
        out[m + "self_attention.linear_proj.weight"] = shard(hf[p + "self_attn.o_proj.weight"], 1)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        gate, up = shard(hf[p + "mlp.gate_proj.weight"], 0), shard(hf[p + "mlp.up_proj.weight"], 0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = shard(hf[p + "mlp.down_proj.weight"], 1)
    if "model.norm.weight" in hf:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not arch.tied_embeddings and "lm_head.weight" in hf:
        out["output_layer.weight"] = shard(_pad_rows(hf["lm_head.weight"], rows), 0)
    return out


def megatron_to_hf_state_dict(shards: Sequence[dict[str, Tensor]], arch: HFArch) -> dict[str, Tensor]:
    """The inverse: Megatron state dicts of all TP ranks (index = tp rank, global layer ids) -> HF tensors."""
    heads_per_group, groups, d = arch.num_heads // arch.num_kv_heads, arch.num_kv_heads, arch.head_dim

    def cat(key: str, dim: int) -> Tensor:
        return torch.cat([s[key] for s in shards], dim=dim)

    def split_qkv(key: str) -> tuple[Tensor, Tensor, Tensor]:
        fused = cat(key, 0)
        rest = fused.shape[1:]
        q, k, v = fused.reshape(groups, (heads_per_group + 2) * d, -1).split([heads_per_group * d, d, d], dim=1)
        return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))

    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size].clone()}
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
        names = ("q_proj", "k_proj", "v_proj")
        suffixes = ("weight", "bias") if arch.qkv_bias else ("weight",)
        for suffix in suffixes:
            for name, t in zip(names, split_qkv(m + "self_attention.linear_qkv." + suffix), strict=True):
                out[f"{p}self_attn.{name}.{suffix}"] = t
        out[p + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        if arch.qk_norm:
            out[p + "self_attn.q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"].clone()
            out[p + "self_attn.k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"].clone()
        out[p + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"].clone()
        gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[p + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up], dim=0)
        out[p + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up], dim=0)
        out[p + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    if not arch.tied_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[: arch.vocab_size].clone()
    return out


# ---------------------------------------------------------------- model-level load / export


def read_hf_state_dict(hf_dir: str | Path, keep=None) -> dict[str, Tensor]:
    """All tensors of a (possibly sharded) safetensors HF checkpoint, on CPU; only the names `keep(name)` accepts
    when given (the others are not read)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise MissingInputError(f"no *.safetensors in {hf_dir}")
    tensors: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            tensors.update({k: reader.get_tensor(k) for k in reader.keys() if keep is None or keep(k)})
    return tensors


def load_hf_weights(model: GPTModel, hf_dir: str | Path) -> None:
    """Copy the HF checkpoint into this rank's slice of `model` (TP shard, PP stage); every parameter must match."""
    arch, tp = model.hf_arch, parallel_state.get_tensor_model_parallel_world_size()
    offset = layer_offset(model)
    own = model.state_dict()
    # Only this stage's tensors are read (a pipeline stage never holds the whole model): its layers, the embedding
    # where it embeds or holds the tied copy, the final norm and output layer on the last stage.
    layers = sorted({offset + int(m[1]) for k in own if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
    embedding = "embedding.word_embeddings.weight" in own or (arch.tied_embeddings and "output_layer.weight" in own)
    wanted_hf = {"model.embed_tokens.weight": embedding, "model.norm.weight": "decoder.final_layernorm.weight" in own,
                 "lm_head.weight": "output_layer.weight" in own}

    def keep(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return int(m[1]) in layers if m else wanted_hf.get(name, False)

    full = hf_to_megatron_state_dict(read_hf_state_dict(hf_dir, keep), arch,
                                     parallel_state.get_tensor_model_parallel_rank(), tp,
                                     padded_vocab_size=model.vocab_size, layers=layers)
    if arch.tied_embeddings and "output_layer.weight" in own:
        # Tied and pipelined: the last stage holds its own copy of the embedding as output_layer.weight, which
        # Megatron keeps in sync through the embedding group; it starts as the same vocab shard.
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    wanted = {k: full[layer_key(k, offset)] for k in own if not k.endswith("_extra_state")}
    model.load_state_dict({**own, **wanted}, strict=True)


def _global_megatron_state_dict(model: GPTModel, adapter_only: bool = False) -> dict[str, Tensor]:
    if isinstance(model, list):  # ModelChunks: each chunk's layers under their global indices
        return {k: v for chunk in model for k, v in _global_megatron_state_dict(chunk, adapter_only).items()}
    offset = layer_offset(model)
    return {
        layer_key(k, offset): v.detach().to("cpu", copy=True)
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state") and isinstance(v, Tensor)
        and (not adapter_only or k.endswith((".lora_A", ".lora_B")))
    }


def gather_shards(model: GPTModel, adapter_only: bool = False) -> list[dict[str, Tensor]] | None:
    """Collective: every rank calls it. On global rank 0, this model's global-keyed state dicts of all TP ranks
    (index = TP rank; PP stages merged by key), only its LoRA tensors with `adapter_only`; None on other ranks."""
    local = _global_megatron_state_dict(model, adapter_only)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    keep = parallel_state.get_data_parallel_rank() == 0
    dist.gather_object((tp_rank, local) if keep else None, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    by_tp: dict[int, dict[str, Tensor]] = {}
    for item in gathered or []:
        if item is not None:
            by_tp.setdefault(item[0], {}).update(item[1])  # PP stages of one TP rank merge by key
    return [by_tp[r] for r in sorted(by_tp)]


def export_hf(model: GPTModel, src_hf_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `model` as an HF folder (model.safetensors, config.json, tokenizer files of `src_hf_dir`), in `dtype`
    (None: the model's own) — config.json's dtype says which.

    Collective: every rank calls it; TP shards and PP stages are gathered to global rank 0, which writes.
    A LoRA model is written merged (W + scale * B A). The folder appears atomically (written as
    `<out_dir>.partial`, then renamed), replacing an older export, so a sampler polling for new weights never
    reads a half-written checkpoint.
    """
    shards = gather_shards(model)
    if shards is not None:
        spec = getattr(model, "lora_spec", None)
        if spec is not None:  # merged in float32 (a bf16 W + B·A would round twice), then cast
            shards = [merge_into({k: v.float() for k, v in s.items()}, spec.scale) for s in shards]
        tensors = megatron_to_hf_state_dict(shards, model.hf_arch)
        dtype = dtype or next(model.parameters()).dtype
        _write_hf_folder({k: v.to(dtype) for k, v in tensors.items()}, Path(src_hf_dir), Path(out_dir))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def export_adapter(model: GPTModel, base_model: str | Path, out_dir: str | Path) -> None:
    """Write a LoRA model's adapter in peft's format (adapter_config.json + adapter_model.safetensors, HF module
    names) for peft's `PeftModel.from_pretrained` and vLLM's `LoRARequest`. Collective, atomic, like export_hf."""
    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise ValueError("export_adapter: the model has no LoRA adapter (train with lora_rank > 0)")
    shards = gather_shards(model, adapter_only=True)
    if shards is not None:
        write_peft_folder(to_peft(shards, model.hf_arch, spec), spec, str(base_model), Path(out_dir))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_hf_folder(tensors: dict[str, Tensor], src: Path, out: Path) -> None:
    with staged_dir(out) as partial:  # a failed write (full disk) leaves neither a partial folder nor a broken `out`
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial / "model.safetensors"), {"format": "pt"})
        config = json.loads((src / "config.json").read_text())
        dtypes = {str(v.dtype).removeprefix("torch.") for v in tensors.values()}
        config["dtype" if "torch_dtype" not in config else "torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else None
        (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in src.iterdir():  # tokenizer, generation config, chat template: everything but weights and config
            if f.is_file() and f.name != "config.json" and not _WEIGHT_FILE.match(f.name):
                shutil.copy2(f, partial / f.name)
