"""The distillation losses: reference (the plain definitions, over full logits), fused (the output layer and the loss
per vocabulary chunk, never a [tokens, vocab] tensor), xtok (the cross-tokenizer losses, uld and gold) and
vocab_parallel (the tensor-parallel reductions they share). A leaf: imports nothing else of the trainer.
"""
