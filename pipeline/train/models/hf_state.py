"""The transformers student's state on disk: what an hf-backend checkpoint holds (rank 0's `student.safetensors`, all
weights or the LoRA adapter, and torch's `optimizer.pt`; an FSDP student's shards gathered into full state dicts, so
one file loads at any world size) and its export as an HF folder or a peft adapter folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from pipeline.config import ConfigError
from pipeline.store.shards import staged_dir
from pipeline.train.models.hf_model import HFStudent, build

MODEL_FILE, OPTIMIZER_FILE = "student.safetensors", "optimizer.pt"


def trainable_state(student: HFStudent) -> dict[str, Tensor]:
    """What a checkpoint holds: the adapters of a LoRA student, else every weight (tied ones once)."""
    if student.lora_spec is not None:
        return {n: p.detach() for n, p in student.named_parameters() if ".lora_" in n}  # peft's adapter names
    return student.state_dict()


def _full_state(student: HFStudent, optimizer) -> tuple[dict, dict | None]:
    """An FSDP student's full model and optimizer state dicts, on CPU (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(student, options=options)
    if student.lora_spec is not None:
        model = {k: v for k, v in model.items() if ".lora_" in k}
    return model, None if optimizer is None else get_optimizer_state_dict(student, optimizer, options=options)


def save_state(folder: Path, student: HFStudent, optimizer, rank: int = 0) -> None:
    """This rank's part of a checkpoint: rank 0 writes (data-parallel replicas are identical; an FSDP student's
    shards are gathered first, by every rank)."""
    from safetensors.torch import save_file, save_model

    if student.fsdp:
        model, opt = _full_state(student, optimizer)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in model.items()}, str(folder / MODEL_FILE))
            if opt is not None:
                torch.save(opt, folder / OPTIMIZER_FILE)
        return
    if rank != 0:
        return
    if student.lora_spec is not None:
        save_file({k: v.contiguous() for k, v in trainable_state(student).items()}, str(folder / MODEL_FILE))
    else:
        save_model(student, str(folder / MODEL_FILE))  # drops the duplicate of tied weights
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)


def load_state(folder: Path, student: HFStudent, optimizer=None) -> None:
    from safetensors.torch import load_file, load_model

    if student.fsdp:  # every rank reads the full state and keeps its shard
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=student.lora_spec is None)
        set_model_state_dict(student, load_file(str(folder / MODEL_FILE)), options=options)
        if optimizer is not None:
            set_optimizer_state_dict(student, optimizer, torch.load(folder / OPTIMIZER_FILE, weights_only=True),
                                     options=StateDictOptions(full_state_dict=True))
        return
    if student.lora_spec is not None:
        state = load_file(str(folder / MODEL_FILE))
        missing = set(trainable_state(student)) - set(state)
        if missing or set(state) - set(trainable_state(student)):
            raise ConfigError(f"{folder / MODEL_FILE}: adapter keys differ from this LoRA student's "
                              f"(e.g. {sorted(missing or set(state))[:2]})")
        student.load_state_dict(state, strict=False)
    else:
        load_model(student, str(folder / MODEL_FILE), strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))


def export(ckpt: Path, meta: dict, hf_dir: Path, out_dir: Path, *, adapter_only: bool, dtype: torch.dtype) -> None:
    """An hf-backend checkpoint as an HF folder (LoRA merged) or, `adapter_only`, as peft's adapter folder; written
    under a temporary name and renamed (pipeline.store.shards.staged_dir)."""
    lora = meta.get("lora")
    student = build(hf_dir, lora=None if lora is None else (lora["rank"], lora["alpha"], lora["targets"]),
                    fused_loss=False, trainable=False)
    load_state(ckpt, student)
    with staged_dir(out_dir) as partial:
        if adapter_only:
            student.lm.save_pretrained(str(partial))
            _set_base(partial / "adapter_config.json", hf_dir)
            return
        lm = student.lm.merge_and_unload() if lora is not None else student.lm
        lm.to(dtype).save_pretrained(str(partial), safe_serialization=True)
        for f in hf_dir.iterdir():  # tokenizer, chat template, generation config: everything but weights/config
            if f.is_file() and not (partial / f.name).exists() and not _is_weights(f.name):
                shutil.copy2(f, partial / f.name)


def _set_base(adapter_config: Path, base: Path) -> None:
    config = json.loads(adapter_config.read_text())
    config["base_model_name_or_path"] = str(base.resolve())  # what vLLM and evaluate.load_hf put it on
    adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json"))
