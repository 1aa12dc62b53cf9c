"""The transformers student backend (`backend=hf`): any `AutoModelForCausalLM` behind the interface the trainer's loop
uses for a Megatron GPTModel, so both backends share one loop, one loader and one loss.

    HFStudent(lm)(input_ids, position_ids, attention_mask=None) -> final normed hidden states [B, S, H]
                                                                   (or logits [B, S, V] with logits=True)
    output_weight(student) -> the LM head's weight [V, H]: the fused loss applies the output layer itself

Which backend trains which family, and the refusals: `pipeline.train.models.families.resolve_backend`.

What the backend does and why:
- The fused loss (pipeline/train/losses/fused.py) takes the decoder's last hidden states and the LM head's weight, so
  no `[tokens, vocab]` logits exist. That is exact only where the model's logits ARE `hidden · Wᵀ` (no bias, no
  soft-capping, no logit scale: Gemma 2's `final_logit_softcapping`, Cohere's `logit_scale`, Granite's
  `logits_scaling` are not); `build` checks it on a probe input and refuses `fused_loss=true` where it is not.
- Packed rows: each row's samples get position ids restarting at 0 (so learned absolute position embeddings are
  exact too, not only RoPE) and a block-diagonal causal `[B, 1, S, S]` mask, which transformers passes to the
  attention as it is. Layers that are not attention (Qwen3.5's / Qwen3-Next's Gated DeltaNet `linear_attention`,
  Mamba) carry a recurrent state across the row: transformers' pure-PyTorch DeltaNet fallback
  (`torch_chunk_gated_delta_rule`) has no sequence-boundary input, so packing is refused for them, naming the layer
  type; every other model is checked on a probe (two samples packed == each alone) before training
  (`packing_refusal`). `packing: auto` pads where packing=true would be refused.
- LoRA through peft (`lora.*` keys as for Megatron; Megatron's layer names map to the HF modules they come from,
  `all-linear` is peft's own); the adapter is what checkpoints and `gkd export --adapter-only` hold.
- bf16: fp32 weights (the optimizer's master copy) with the body under `torch.autocast(bfloat16)`; the output layer
  and the loss run in float32.
- Data parallelism: torch DDP with a hook that sums gradients over ranks instead of averaging them (the loss is
  already normalised by the global active count: train/step.py's module docstring). `fsdp: true`: FSDP2
  (`fully_shard` on every decoder layer and on the whole student) shards weights, gradients and optimizer state
  over the ranks, for students that do not fit one device. FSDP2 averages gradients and gloo has no PREMUL_SUM for
  a divide factor of 1, so the loss is multiplied by the data-parallel size instead (exact for powers of two). After
  the root's forward its own parameters (embeddings, final norm, LM head) stay unsharded until backward, which is
  when the fused loss reads the head's weight. Checkpoints gather full state dicts (one file, loadable at any
  world size), and each rank takes its shard back on resume.
- Gradient checkpointing: `recompute=selective|full` both checkpoint whole decoder layers (transformers has no
  finer grain).
- Tensor parallelism: none (refused); use the Megatron backend for the families it maps.
- Vision-language students (a config.json with `vision_config`: Qwen2-VL, Qwen2.5-VL, Qwen3.5, LLaVA-style):
  loaded with AutoModelForImageTextToText beside their processor. A micro-batch's images (`MicroBatch.images`) go
  through the student's processor (`vision_inputs`: pixel values and the family's grid sizes), and each image's
  expansion must equal the placeholder run the rows hold (refused naming the sample otherwise). The model computes
  its own positions (Qwen's 3-D M-RoPE), so rows are padded, not packed (packing=true is refused, auto pads). The loss runs on text
  positions only: images sit in prompts. The vision tower is frozen; LoRA adapts the language model, and the
  connector too where `lora.targets` names `connector`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.config import ConfigError
from pipeline.store import images as image_store
from pipeline.store.model_config import vocab_size
from pipeline.train.data.batch import Images
from pipeline.train.data.packing import attention_mask
from pipeline.train.models.lora import ALIASES, HF_MODULES, TARGETS, LoRASpec
from pipeline.train.models.optim import lr_scheduler, torch_optimizer

# Layer types (config.layer_types) that are attention and so keep packed samples apart under a block-diagonal mask.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
# Where the vision tower and the connector (projector) of vision-language students live, by module name
VISION_MODULES = ("visual", "vision_tower", "vision_model")
CONNECTOR_MODULES = ("merger", "multi_modal_projector", "connector")
# Fixed seed and sizes of the probes `build` runs (packing, fused output layer): small enough to cost a few forwards.
_PROBE_SEED, _PROBE_LENGTHS = 1234, (5, 7)
_PROBE_RTOL = 1e-4


class HFStudent(nn.Module):
    """A transformers causal LM (optionally peft-wrapped) as the trainer's loop sees a model.

    `forward` returns the decoder's final (normed) hidden states, or the logits with `logits=True` (the unfused
    reference path). Attributes the loop, the loss and the checkpoints read: `hf_vocab_size`, `lora_spec`
    (None for full fine-tuning), `precision`, `gkd_backend`."""

    gkd_backend = "hf"

    def __init__(self, lm: nn.Module, *, logits: bool = False, lora_spec: LoRASpec | None = None,
                 precision: str = "fp32", processor=None):
        super().__init__()
        self.lm = lm  # not `module`: the trainer unwraps DDP by that name
        self.logits = logits
        self.fsdp = False  # set by wrap_data_parallel(fsdp=True)
        self.lora_spec = lora_spec
        self.precision = precision
        self.hf_vocab_size = int(self.base().get_output_embeddings().weight.shape[0])
        self.processor = processor  # a vision-language student's (None: text-only)
        self.image_token = None if processor is None else image_store.image_token_id(self.base().config.to_dict())

    def base(self) -> nn.Module:
        """The transformers model (inside peft's wrapper for a LoRA student; its layers carry the adapters)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                **vision: Tensor) -> Tensor:
        dev = input_ids.device.type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            if self.processor is not None:  # the model's own positions (M-RoPE from the image grids)
                kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **vision)
                out = self.base()(**kw).logits if self.logits else self.base().model(**kw).last_hidden_state
            elif self.logits:
                out = self.base()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                  use_cache=False).logits
            else:
                out = self.base().get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                                attention_mask=attention_mask, use_cache=False).last_hidden_state
        return out.float()  # the output layer and the loss run in float32

    def output_weight(self) -> Tensor:
        return self.base().get_output_embeddings().weight

    def arch_json(self) -> dict:
        """What a checkpoint records of the student, to refuse a resume or export with another one."""
        c = self.base().config
        keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "layer_types")
        return {k: getattr(c, k, None) for k in keys}


def is_hf(model: nn.Module) -> bool:
    return getattr(model, "gkd_backend", None) == "hf"


def vision_inputs(student: HFStudent, input_ids: Tensor, part: Images | None, keys: Sequence[str]) -> dict:
    """The student processor's pixel inputs of a micro-batch's images part (rows in order, each row's images in
    placeholder order), after checking that the processor expands each image to exactly the placeholder run the row
    holds (the rows were aligned to the teacher's expansion when they were scored)."""
    images = part.rows if part is not None else None
    if student.processor is None:
        if images and any(images):
            raise ConfigError(f"the cache rows of {next(iter(keys), '?')} carry images, but the student is a "
                              "text-only model: it would see placeholders without pixels; train a vision-language "
                              "student on this cache (the trainer refuses this before the model is built: "
                              "setup.check_images)")
        return {}
    if not images or not any(images):
        return {}
    flat = [(row, root, h) for row, imgs in enumerate(images) for root, h in imgs]
    pixels = [image_store.load(root, [h], sample=keys[row] if row < len(keys) else "")[0] for row, root, h in flat]
    proc = student.processor
    placeholder = getattr(proc, "image_token", None) or proc.tokenizer.decode([student.image_token])
    out = proc(text=[placeholder] * len(pixels), images=pixels, padding=True, return_tensors="pt")
    expanded = (out["input_ids"] == student.image_token).sum(1).tolist()
    ids = input_ids.cpu().numpy()
    i = 0
    for row, imgs in enumerate(images):
        found = [n for _, n in image_store.runs(ids[row], student.image_token)]
        want = expanded[i: i + len(imgs)]
        i += len(imgs)
        if found != want:
            raise ConfigError(
                f"sample {keys[row] if row < len(keys) else row}: the student's processor expands its images to "
                f"{want} placeholder tokens, the cache row holds {found}: another processor (version, "
                "max_pixels/min_pixels) than the one that made the rollouts, or a row cut at seq_length (raise "
                "seq_length); train with the processor the rollouts were made with")
    dev = input_ids.device
    kw = {k: v.to(dev) for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in out:  # which tokens are image placeholders (M-RoPE), for the rows themselves
        kw["mm_token_type_ids"] = (input_ids == student.image_token).long()
    return kw


# ---------------------------------------------------------------- inputs


def inputs(doc_ids: Tensor, position_ids: Tensor, packed: bool, attn_implementation: str) -> dict:
    """`HFStudent.forward` keywords of a micro-batch. Padded rows: the model's own causal mask (padding is at the
    end of each row, after every loss position). Packed rows: positions restarting at each sample and the
    block-diagonal causal mask (bool, True = attend, for sdpa; additive elsewhere)."""
    if not packed:
        return {"position_ids": position_ids, "attention_mask": None}
    s = doc_ids.shape[-1]
    col = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new_doc, col, 0).cummax(-1).values  # column where each token's sample starts
    masked = attention_mask(doc_ids)  # the Megatron backend's block-diagonal mask, True = masked out
    allowed = ~masked
    if attn_implementation != "sdpa":
        allowed = torch.zeros(masked.shape, dtype=torch.float32, device=doc_ids.device).masked_fill_(
            masked, torch.finfo(torch.float32).min)
    return {"position_ids": col - start, "attention_mask": allowed}


# ---------------------------------------------------------------- build


def lora_targets(targets: Sequence[str], lm: nn.Module, *, vision: bool = False) -> list[str] | str:
    """peft `target_modules` for `targets`: Megatron's layer names (and their short names) become the HF modules they
    are made of, HF module names pass through, `all-linear` is peft's own. A name that matches no linear layer of
    the model is refused, naming the ones it could match. A vision-language model: the language model's layers
    only, by full module name (the vision tower stays frozen), plus the connector's where `connector` is named."""
    if vision:
        return _vision_lora_targets(targets, lm)
    if "all-linear" in targets:
        return "all-linear"
    head = lm.get_output_embeddings()
    names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear) and m is not head})
    out: list[str] = []
    for t in targets:
        kind = ALIASES.get(t, t)
        out += [m.rsplit(".", 1)[-1] for m in HF_MODULES[kind]] if kind in TARGETS else [t]
    missing = sorted({t for t in out if t not in names})
    if missing:
        raise ConfigError(f"lora_targets: {', '.join(missing)} match(es) no linear layer of this "
                          f"{lm.config.model_type} model; it has {', '.join(names)} (or use all-linear; the output "
                          "layer is not adaptable)")
    return list(dict.fromkeys(out))


def _vision_lora_targets(targets: Sequence[str], lm: nn.Module) -> list[str]:
    head = lm.get_output_embeddings()
    linears = [n for n, m in lm.named_modules() if isinstance(m, nn.Linear) and m is not head]
    in_vision = [n for n in linears if any(f".{v}." in f".{n}" for v in VISION_MODULES + CONNECTOR_MODULES)]
    connector = [n for n in in_vision if any(f".{c}." in f".{n}" for c in CONNECTOR_MODULES)]
    text = [n for n in linears if n not in in_vision]
    wanted = [t for t in targets if t != "connector"]
    short = {n.rsplit(".", 1)[-1] for n in text}
    if "all-linear" in wanted:
        names = set(short)
    else:
        names = set()
        for t in wanted:
            kind = ALIASES.get(t, t)
            names |= {m.rsplit(".", 1)[-1] for m in HF_MODULES[kind]} if kind in TARGETS else {t}
        missing = sorted(names - short)
        if missing:
            raise ConfigError(f"lora_targets: {', '.join(missing)} match(es) no linear layer of this "
                              f"{lm.config.model_type} model's language model; it has {', '.join(sorted(short))} (or "
                              "all-linear, and connector for the vision connector)")
    out = [n for n in text if n.rsplit(".", 1)[-1] in names]
    if "connector" in targets:
        if not connector:
            raise ConfigError(f"lora_targets: connector: this {lm.config.model_type} model has no connector module "
                              f"({', '.join(CONNECTOR_MODULES)})")
        out += connector
    return out


def is_vision(hf_dir: str | Path) -> bool:
    """Whether an HF folder holds a vision-language model (its config.json has a `vision_config`)."""
    return bool(json.loads((Path(hf_dir) / "config.json").read_text()).get("vision_config"))


def build(hf_dir: str | Path, *, lora: tuple[int, float, Sequence[str]] | None = None, seed: int = 0,
          fused_loss: bool = True, packing: bool | str = False, precision: str = "fp32", attention: str = "sdpa",
          recompute: str = "none", trainable: bool = True) -> HFStudent:
    """The student (or, with `trainable=False`, a frozen live teacher) from an HF folder, in float32 weights;
    `lora` = (rank, alpha, targets). Refuses, before training, what this backend would compute wrongly: a fused
    output layer where the logits are not `hidden · Wᵀ`, packing across layers that do not keep samples apart.
    `packing="auto"`: packed where the model keeps packed samples apart (`packing_refusal` finds nothing), padded
    otherwise; the result says which and why (`HFStudent.packing`, `.packing_why`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    attn = {"sdpa": "sdpa", "local": "eager"}[attention]
    vision = is_vision(hf_dir)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    lm = auto.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation=attn)
    processor = AutoProcessor.from_pretrained(str(hf_dir)) if vision else None
    why = "packing=true" if packing is True else "packing=false"
    if vision and packing and packing != "auto":
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: packing=true, but this is a vision-language model "
                          f"({lm.config.model_type}), which computes its own positions per row from the image grids "
                          "(M-RoPE); set packing=false (or packing=auto, which pads its rows)")
    if vision:
        for name, p in lm.named_parameters():  # the vision tower (and connector) stay frozen in full fine-tuning
            if any(f".{m}." in f".{name}" for m in VISION_MODULES):
                p.requires_grad_(False)
    if packing == "auto":
        reason = (f"this is a vision-language model ({lm.config.model_type}), which computes its own positions per "
                  "row from the image grids (M-RoPE)") if vision else packing_refusal(lm)
        packing = reason is None
        why = ("auto: packed, this model keeps packed samples apart (probe: two samples packed == each alone)"
               if packing else f"auto: padded rows, {reason}")
    elif packing:
        check_packing(lm, hf_dir)
    if fused_loss:
        check_fused(lm, hf_dir)
    spec = None
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        rank, alpha, targets = lora
        modules = lora_targets(targets, lm, vision=vision)
        spec = LoRASpec(rank, alpha, (modules,) if isinstance(modules, str) else tuple(modules))
        torch.manual_seed(seed)  # peft's A init (B starts at zero): the same adapter for the same seed
        lm = get_peft_model(lm, LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0,
                                           bias="none"))
    if recompute != "none" and trainable:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            lm.enable_input_require_grads()  # checkpointed layers need an input that requires grad (frozen base)
    student = HFStudent(lm, logits=not fused_loss, lora_spec=spec, precision=precision, processor=processor)
    student.packing, student.packing_why = bool(packing), why
    if not trainable:
        student.requires_grad_(False)
        return student.eval()
    return student.train()


def _probe_ids(vocab: int, n: int, generator: torch.Generator) -> Tensor:
    return torch.randint(0, vocab, (1, n), generator=generator)


def packing_refusal(lm: nn.Module) -> str | None:
    """Why a row's packed samples would not stay apart in this model (None: they do): non-attention layer types by
    name, anything else by a probe (two samples packed in one row against each alone, in eval mode)."""
    types = list(getattr(lm.config, "layer_types", None) or [])
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return (f"layer_types has {', '.join(other)} ({sum(t in other for t in types)} of {len(types)} layers), which "
                "carries state from one sample of a packed row into the next (its short causal convolution gets no "
                "document boundaries on any device, nor does transformers' fallback delta-rule kernel: "
                "docs/dependencies.md)")
    g = torch.Generator().manual_seed(_PROBE_SEED)
    docs = [_probe_ids(vocab_size(lm.config), n, g) for n in _PROBE_LENGTHS]
    row = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    kw = inputs(doc_ids, torch.arange(row.shape[1])[None], True, lm.config._attn_implementation)
    was_training = lm.training
    lm.eval()
    with torch.no_grad():
        packed = lm(input_ids=row, use_cache=False, **kw).logits[0]
        alone = torch.cat([lm(input_ids=d, use_cache=False).logits[0] for d in docs])
    lm.train(was_training)
    gap = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-30))
    if gap > _PROBE_RTOL:
        return (f"this {lm.config.model_type} model gives two samples packed in one row other logits than each alone "
                f"(max gap {gap:.1e} of the logits' scale): it does not keep packed samples apart")
    return None


def check_packing(lm: nn.Module, hf_dir: str | Path) -> None:
    """Refuse packing=true where the model cannot keep a row's samples apart (`packing_refusal`)."""
    if (reason := packing_refusal(lm)) is not None:
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: packing=true, but {reason}; set packing=false (or "
                          "packing=auto, which pads such a model's rows)")


def check_fused(lm: nn.Module, hf_dir: str | Path) -> None:
    """Refuse the fused output layer + loss where the model's logits are not `final hidden · Wᵀ`."""
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: fused_loss=true needs a bias-free linear output layer, "
                          f"this {lm.config.model_type} model has {type(head).__name__}; set fused_loss=false")
    ids = _probe_ids(vocab_size(lm.config), 8, torch.Generator().manual_seed(_PROBE_SEED))
    with torch.no_grad():
        logits = lm(input_ids=ids, use_cache=False).logits[0]
        hidden = lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        gap = float((hidden @ head.weight.T - logits).abs().max() / logits.abs().max().clamp_min(1e-30))
    if gap > _PROBE_RTOL:
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: fused_loss=true applies the output layer to the final "
                          f"hidden states, but this {lm.config.model_type} model's logits are not hidden · Wᵀ (max "
                          f"gap {gap:.1e}: a soft-cap or logit scale); set fused_loss=false")


def wrap_data_parallel(student: HFStudent, fsdp: bool = False) -> nn.Module:
    """torch DDP over the default group when there are several processes, gradients SUMMED over ranks; with `fsdp`,
    FSDP2 in place (the student itself is returned, sharded; see the module docstring)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return student
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
        for layer in student.base().get_decoder().layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(student, mesh=mesh)
        student.fsdp = True
        return student
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(student, broadcast_buffers=False)

    def sum_hook(group, bucket):
        return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, sum_hook)
    return ddp


def optimizer_and_scheduler(student: HFStudent, cfg):
    """The optimizer Megatron's `get_megatron_optimizer` builds on CPU (torch AdamW, betas 0.9/0.95, eps 1e-8, or
    SGD with momentum 0.9; no weight decay on biases and 1-D weights) and Megatron's own warmup + cosine schedule,
    so both backends train with the same update rule (pipeline/train/models/optim.py)."""
    decay, no_decay = [], []
    for name, p in student.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
    opt = torch_optimizer([g for g in groups if g["params"]], cfg)
    return opt, lr_scheduler(opt, cfg)


def clip_and_step(student: HFStudent, optimizer, clip_grad: float) -> float:
    """Megatron's step on fp32 grads: global L2 norm, clip to `clip_grad` (0: no clipping), then the update.
    Returns the norm before clipping."""
    params = [p for p in student.parameters() if p.requires_grad and p.grad is not None]
    if clip_grad > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    optimizer.step()
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards
    return float(norm)


# ---------------------------------------------------------------- checkpoints and export
