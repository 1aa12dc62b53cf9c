"""Export a trained student checkpoint for transformers / vLLM / peft. The entry (`gkd export`) is
pipeline/train/export_run.py.

A checkpoint of the hf backend (trainer.json `backend: hf`) is written by transformers' `save_pretrained` (the
adapter by peft's). A Megatron one: one process at TP=1: dist_checkpointing reshards a checkpoint saved at any TP degree on load. The architecture and
tokenizer come from the student folder recorded in the checkpoint's trainer.json (override with --student); a
LoRA checkpoint holds only the adapter, which is put back on that folder's base weights. A LoRA checkpoint exports
merged unless --adapter-only is given.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import InputError, MissingInputError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}


def student_dtype(hf_dir: Path) -> str:
    """The dtype a student folder's config.json declares (`dtype`, or the older `torch_dtype`); float32 if none."""
    import json

    config = json.loads((hf_dir / "config.json").read_text())
    return DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "float32")


def export(checkpoint_path: str | Path, out_dir: str | Path, student: str | Path | None = None,
           adapter_only: bool = False, dtype: str | None = None) -> Path:
    """Write the checkpoint's model as an HF folder (or, with `adapter_only`, its LoRA adapter in peft format), in
    `dtype` (float32 | bfloat16 | float16; None: the student's config dtype)."""
    import torch

    from pipeline.train import checkpoint
    from pipeline.train.models.lora import LoRASpec, apply_lora
    from pipeline.train.models.megatron import build_model, export_adapter, export_hf, load_hf_weights
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    ckpt = checkpoint.latest(checkpoint_path)
    if ckpt is None:
        raise MissingInputError(f"{checkpoint_path}: no checkpoint (no trainer.json and no `latest` file)")
    meta = checkpoint.read_meta(ckpt)
    hf_dir = Path(student or meta["student"])
    lora = meta.get("lora")
    if adapter_only and lora is None:
        raise InputError(f"{ckpt}: --adapter-only needs a LoRA run (trainer.json has no lora settings); "
                         "this checkpoint holds full weights, export it without --adapter-only")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: choose one of float32, bfloat16, float16")
    out_dtype = getattr(torch, DTYPES[dtype] if dtype else student_dtype(hf_dir))
    if meta.get("backend") == "hf":  # transformers' own save_pretrained (peft's for the adapter): no Megatron
        from pipeline.train.models.hf_state import export as export_hf_backend

        export_hf_backend(ckpt, meta, hf_dir, Path(out_dir), adapter_only=adapter_only, dtype=out_dtype)
        return Path(out_dir)
    # Built in the checkpoint's precision, so its tensors load as they were saved; cast on writing.
    params_dtype = torch.bfloat16 if meta.get("precision") == "bf16" else torch.float32
    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(hf_dir, params_dtype=params_dtype)
        if lora is not None:
            load_hf_weights(model, hf_dir)  # the frozen base; the checkpoint has the adapter only
            apply_lora(model, LoRASpec(lora["rank"], lora["alpha"], tuple(lora["targets"])))
        checkpoint.load(ckpt, model)
        if adapter_only:
            export_adapter(model, hf_dir, out_dir)
        else:
            export_hf(model, hf_dir, out_dir, dtype=out_dtype)
    finally:
        destroy_distributed()
    return Path(out_dir)
