"""Live teachers: a frozen teacher run beside the student per micro-batch instead of a cache. live (its top-k,
tail and actual-token rows, what the score stage would store), live_xtok (the same for a teacher with another
tokenizer, placed over the spans the loader laid out in data/xtok_rows.py).
"""
