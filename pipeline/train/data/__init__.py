"""The trainer's data path: cache shards and rollouts -> micro-batches in the student's layout.

sources (which shards, checked at load) -> shard_table (the index's rows per shard) -> order (the epoch's sample
order and the step plan) -> blocks (decoded shard slices; rollout rows for a live teacher, xtok_rows for one with
another tokenizer) -> batch (the micro-batch types and their assembly, padded or packed) -> loader (`ScoredLoader`,
the iterator the loop reads), with routing (per-sample teacher choice), packing (the packed attention mask) and
prefetch (a background thread) beside them. Imports only the store and the losses' leaf helpers, never a model.
"""
