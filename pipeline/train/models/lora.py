"""LoRA adapters on Megatron-Core's tensor-parallel linear layers, and their peft-format export.

    y = W x + (alpha / r) * B (A x)          A: [r, in], B: [out, r]; B starts at zero, so y is unchanged at init

Why our own wrapper (about 150 lines) rather than peft or NVIDIA modelopt: peft wraps `torch.nn.Linear` only, and
Megatron's Column/RowParallelLinear are not that (docs/dependencies.md); modelopt's peft mode was tried on this machine
(notes in docs/architecture.md, "LoRA students"). Our wrapper adds two parameters to the existing layer and a
forward hook, so every state-dict key of the base model stays as it is: HF loading, full-weight export and the
TP mapping in `model.py` need no LoRA case.

Tensor parallelism (the layouts follow the base weight, so TP=2 computes exactly what TP=1 does):

    column-parallel (linear_qkv, linear_fc1): W is split along out.
        A [r, in] replicated; B [out/tp, r] split like W's rows.
        h = A x on every rank (same x), then copy_to_tensor_model_parallel_region: identity forward, all-reduce of
        dL/dh backward (each rank's B sees only its rows of dL/dy), so dA and dx are complete and equal on all ranks.
    row-parallel (linear_proj, linear_fc2): W is split along in (the input is already split).
        A [r, in/tp] split like W's columns; B [out, r] replicated.
        h = all-reduce(A_local x_local) (reduce_from_tensor_model_parallel_region), then B h on every rank.

Replicated parameters get identical gradients on every TP rank by construction, so no extra reduction is needed;
they carry `tensor_model_parallel=False`, which makes Megatron count them once in the gradient norm.
linear_fc1's B keeps Megatron's per-rank [gate_r; up_r] row order, like the weight, so checkpoints use Megatron's
SwiGLU sharded factory to reshard it and the exporter splits it back into gate/up.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.store.shards import staged_dir
from pipeline.train.models.layers import layer_key, layer_offset

Tensor = torch.Tensor

COLUMN = ("linear_qkv", "linear_fc1")
ROW = ("linear_proj", "linear_fc2")
TARGETS = COLUMN + ROW
ALIASES = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}
# The HF modules each Megatron layer becomes (fused qkv and gate/up are split back on export).
HF_MODULES = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def resolve_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Megatron layer names from user names: linear_qkv or qkv, ..., peft's HF names (q_proj, ..., down_proj) or
    all-linear. Raises ValueError naming the bad ones (a fused layer needs all of its HF parts)."""
    hf = {m.rsplit(".", 1)[-1]: t for t, ms in HF_MODULES.items() for m in ms}
    out, bad, parts = [], [], set()
    for t in targets:
        if t == "all-linear":
            out += TARGETS
        elif ALIASES.get(t, t) in TARGETS:
            out.append(ALIASES.get(t, t))
        elif t in hf:
            parts.add(t)
        else:
            bad.append(t)
    for kind, modules in HF_MODULES.items():
        names = {m.rsplit(".", 1)[-1] for m in modules}
        if names & parts and not names <= parts:
            bad.append(f"{sorted(names & parts)} without {sorted(names - parts)} (one fused Megatron layer {kind})")
        elif names & parts:
            out.append(kind)
    if bad:
        raise ValueError(f"lora_targets: cannot adapt {bad}; choose from {list(TARGETS)}, their short names "
                         f"{list(ALIASES)}, HF names (q_proj, ..., down_proj) or all-linear; the output layer is "
                         "not adaptable")
    if not out:
        raise ValueError("lora_targets: give at least one layer")
    return tuple(t for t in TARGETS if t in out)  # canonical order, no duplicates


def _layer_kind(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    return leaf if leaf in TARGETS else None


def lora_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every layer that carries an adapter, in model order."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "lora_scale", None) is not None]


def is_lora(model: torch.nn.Module) -> bool:
    return getattr(model, "lora_spec", None) is not None


def _hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    x = args[0]
    out, bias = output
    group = parallel_state.get_tensor_model_parallel_group()
    if module.lora_column:
        h = copy_to_tensor_model_parallel_region(F.linear(x, module.lora_A), group=group)
    else:
        h = reduce_from_tensor_model_parallel_region(F.linear(x, module.lora_A), group=group)
    return out + F.linear(h, module.lora_B) * module.lora_scale, bias


def apply_lora(model: torch.nn.Module, spec: LoRASpec, seed: int = 0) -> None:
    """Freeze `model` and give every targeted layer an adapter (A: Kaiming-uniform as peft does, B: zeros).

    A is drawn from a generator seeded per layer over the *global* shape, then sliced, so any TP degree starts
    from the same adapter. Call after the base weights are loaded. (Megatron is imported in the functions that use
    it: the hf backend and the on-policy engine actors read this module's names without it, and it costs seconds.)
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for p in model.parameters():
        p.requires_grad_(False)
    targeted = [(n, m, kind) for n, m in model.named_modules() if (kind := _layer_kind(n)) in spec.targets]
    # Each adapter's seed counts the targeted layers before it in the *whole* model (pipeline stages included: the
    # stage's first layer is global layer `offset`), so any PP degree starts from the PP=1 adapter.
    offset = layer_offset(model)
    per_layer = Counter(_layer_index(n) for n, _, _ in targeted)
    within: Counter = Counter()
    for name, module, kind in targeted:
        layer = _layer_index(name)
        count = (offset + layer) * per_layer[layer] + within[layer]
        within[layer] += 1
        w = module.weight
        column = kind in COLUMN
        in_full = w.shape[1] * (1 if column else tp)
        a = torch.empty(spec.rank, in_full, dtype=w.dtype)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + count)
        # peft's init: kaiming_uniform_(a=sqrt(5)) -> bound = 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(in_full)
        a.uniform_(-bound, bound, generator=gen)
        if not column:
            a = a.chunk(tp, dim=1)[tp_rank].contiguous()
        b = torch.zeros(w.shape[0], spec.rank, dtype=w.dtype)
        module.lora_A = torch.nn.Parameter(a.to(w.device))
        module.lora_B = torch.nn.Parameter(b.to(w.device))
        set_tensor_model_parallel_attributes(module.lora_A, not column, 1, 1)
        set_tensor_model_parallel_attributes(module.lora_B, column, 0, 1)
        module.lora_column, module.lora_scale, module.lora_kind = column, spec.scale, kind
        module.register_forward_hook(_hook)
    if not targeted:
        raise ValueError(f"no layer of the model matches lora targets {spec.targets}")
    model.lora_spec = spec


def lora_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """This rank's adapter parameters by global model key (`decoder.layers.N.linear_qkv.lora_A`, N counted over the
    whole model), the tensors themselves."""
    offset = layer_offset(model)  # under pipeline parallelism each stage numbers its own layers from 0
    return {layer_key(f"{n}.{p}", offset): getattr(m, p) for n, m in lora_modules(model) for p in ("lora_A", "lora_B")}


def lora_sharded_state_dict(model: torch.nn.Module) -> dict:
    """dist_checkpointing view of the adapter only (global shapes and global layer keys, so a TP=2 or PP=2 checkpoint
    loads at TP=1 or PP=1)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out, offset = {}, layer_offset(model)
    for n, m in lora_modules(model):
        for p in ("lora_A", "lora_B"):
            key, t = layer_key(f"{n}.{p}", offset), getattr(m, p)
            split = (p == "lora_B") if m.lora_column else (p == "lora_A")
            if not split:
                out[key] = make_sharded_tensor_for_checkpoint(t, key)
            elif m.lora_kind == "linear_fc1":
                out[key] = apply_swiglu_sharded_factory(make_tp_sharded_tensor_for_checkpoint(t, key, 0), ())
            else:
                out[key] = make_tp_sharded_tensor_for_checkpoint(t, key, 0 if m.lora_column else 1)
    return out


def load_lora_state(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a loaded adapter state (same keys as `lora_state_dict`) into the model; every key must match."""
    own = lora_state_dict(model)
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"adapter checkpoint does not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k])


# ---------------------------------------------------------------- export (pure functions over gathered TP shards)


def _layer_index(key: str) -> int:
    return int(key.split("decoder.layers.", 1)[1].split(".", 1)[0])


def merge_into(shard: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """One TP rank's global-keyed state dict with adapters folded into the base weights (W + scale * B A), without
    the adapter keys. Exact per rank: column layers pair B's row slice with the full A, row layers A's column
    slice with the full B."""
    out = {k: v for k, v in shard.items() if not k.endswith((".lora_A", ".lora_B"))}
    for key in [k for k in shard if k.endswith(".lora_A")]:
        base = key.removesuffix(".lora_A")
        a, b = shard[key], shard[base + ".lora_B"]
        out[base + ".weight"] = shard[base + ".weight"] + scale * (b @ a)
    return out


def to_peft(shards: Sequence[dict[str, Tensor]], arch, spec: LoRASpec) -> dict[str, Tensor]:
    """Gathered Megatron adapter shards (index = TP rank, global layer ids) -> peft's tensors with HF names.

    Fused layers share one A, so q/k/v (gate/up) each get that A and their row block of B: B_q A x == (B A x)_q.
    """
    heads_per_group, groups, d = arch.num_heads // arch.num_kv_heads, arch.num_kv_heads, arch.head_dim
    out: dict[str, Tensor] = {}

    def put(layer: int, module: str, a: Tensor, b: Tensor) -> None:
        stem = f"{PEFT_PREFIX}model.layers.{layer}.{module}"
        out[stem + ".lora_A.weight"] = a.contiguous().clone()
        out[stem + ".lora_B.weight"] = b.contiguous().clone()

    for key in sorted(k for k in shards[0] if k.endswith(".lora_A")):
        base, layer = key.removesuffix(".lora_A"), _layer_index(key)
        kind = base.rsplit(".", 1)[-1]
        if kind == "linear_qkv":
            a = shards[0][key]
            b = torch.cat([s[base + ".lora_B"] for s in shards], 0).reshape(groups, (heads_per_group + 2) * d, -1)
            q, k, v = b.split([heads_per_group * d, d, d], dim=1)
            for name, t in zip(HF_MODULES[kind], (q, k, v), strict=True):
                put(layer, name, a, t.reshape(-1, t.shape[-1]))
        elif kind == "linear_fc1":
            a = shards[0][key]
            gate_up = [s[base + ".lora_B"].chunk(2, dim=0) for s in shards]
            put(layer, "mlp.gate_proj", a, torch.cat([g for g, _ in gate_up], 0))
            put(layer, "mlp.up_proj", a, torch.cat([u for _, u in gate_up], 0))
        else:  # row-parallel: A split along in, B replicated
            a = torch.cat([s[key] for s in shards], 1)
            put(layer, HF_MODULES[kind][0], a, shards[0][base + ".lora_B"])
    return out


def from_peft(tensors: dict[str, Tensor], arch, spec: LoRASpec, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Tensor]:
    """The inverse of `to_peft` for one TP rank: peft tensors (HF names) -> this rank's adapter state, keyed like
    `lora_state_dict` (global layer ids). q/k/v (gate/up) must share one A, as `to_peft` writes them."""
    heads_per_group, groups, d = arch.num_heads // arch.num_kv_heads, arch.num_kv_heads, arch.head_dim
    megatron = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
    out: dict[str, Tensor] = {}
    for layer in range(arch.num_layers):
        for kind in spec.targets:
            stem = f"{PEFT_PREFIX}model.layers.{layer}."
            a_parts = [tensors[f"{stem}{m}.lora_A.weight"] for m in HF_MODULES[kind]]
            b_parts = [tensors[f"{stem}{m}.lora_B.weight"] for m in HF_MODULES[kind]]
            if any(not torch.equal(a, a_parts[0]) for a in a_parts):
                raise ValueError(f"layer {layer}: {HF_MODULES[kind]} have different lora_A; Megatron's fused "
                                 f"{kind} needs one shared A")
            a = a_parts[0]
            if kind == "linear_qkv":
                q, k, v = b_parts
                r = q.shape[1]
                fused = torch.cat([q.reshape(groups, heads_per_group * d, r), k.reshape(groups, d, r),
                                   v.reshape(groups, d, r)], dim=1)
                b = fused.chunk(tp_size, 0)[tp_rank].reshape(-1, r)
            elif kind == "linear_fc1":
                b = torch.cat([t.chunk(tp_size, 0)[tp_rank] for t in b_parts], 0)
            else:
                a, b = a.chunk(tp_size, 1)[tp_rank], b_parts[0]
            key = f"decoder.layers.{layer}.{megatron[kind]}"
            out[key + ".lora_A"], out[key + ".lora_B"] = a.contiguous().clone(), b.contiguous().clone()
    return out


def peft_config(spec: LoRASpec, base_model: str) -> dict:
    """adapter_config.json as peft writes it for a plain LoRA (the fields peft and vLLM read)."""
    modules = sorted({m.rsplit(".", 1)[-1] for t in spec.targets for m in HF_MODULES[t]})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
        "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def write_peft_folder(tensors: dict[str, Tensor], spec: LoRASpec, base_model: str, out: Path) -> None:
    """adapter_model.safetensors + adapter_config.json, appearing atomically at `out` (replacing an older one)."""
    from safetensors.torch import save_file

    with staged_dir(out) as partial:
        save_file(tensors, str(partial / "adapter_model.safetensors"), {"format": "pt"})
        (partial / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
