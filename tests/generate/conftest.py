"""Tiny fixtures for the generate stage: a self-built BPE tokenizer with a chat template, a random tiny Llama, a
random LoRA adapter for it, and one vLLM engine shared by a test module (start-up is the slow part).

Nothing here needs a download. The tokenizer's post-processor adds a BOS *and* its chat template starts with the
BOS, like Llama 3: tokenizing the rendered template again would give two BOS tokens, the trap the stage avoids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]


def _corpus() -> list[str]:
    words = "the a cat dog sat ran on mat under big small red blue one two three four five plus minus equals".split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * k + k * k) % len(words)] for k in range(1, 9)) + f" {i} + {i % 7} = {i + i % 7}.")
    return lines


def build_tokenizer(out: Path) -> Path:
    """A ~500-token byte-level BPE trained in the fixture, saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="<|im_end|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def build_model(out: Path, vocab_size: int, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 128, 2 heads of 64: vLLM's CPU attention needs head_dim >= 32), fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init: samples differ visibly between models
        model.lm_head.weight.mul_(20)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "torch_dtype": "float32"}, indent=1))
    return out


def build_lora(model_dir: Path, out: Path, rank: int = 8, seed: int = 1) -> Path:
    """A random peft LoRA adapter with a non-zero B (peft initialises B to zero, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_student(tmp_path_factory) -> Path:
    """A model folder (weights + tokenizer) like a trainer export."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny")
    build_tokenizer(root / "student")
    tok = AutoTokenizer.from_pretrained(root / "student")
    build_model(root / "student", vocab_size=len(tok))
    return root / "student"


@pytest.fixture(scope="session")
def tiny_lora(tiny_student, tmp_path_factory) -> Path:
    return build_lora(tiny_student, tmp_path_factory.mktemp("lora") / "adapter")
