"""The students: megatron (Megatron-Core GPT models built from an HF config, weights in and out), hf_model (the
transformers backend: one step, FSDP2), families (which backend and attention a config gets), attention, recompute,
lora and optim (one optimizer and LR-schedule builder for both backends).
"""
