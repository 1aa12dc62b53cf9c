"""The trainer's two metrics sinks agree: the TensorBoard event file, read back with TensorBoard's own reader, holds
every scalar metrics.jsonl has, step for step (float32 in the event file: compared to float32 rounding)."""

from __future__ import annotations

import json

import numpy as np

from pipeline.cli import main as gkd

SCALARS = ("loss", "jsd", "sft", "lr", "grad_norm", "tokens_per_s", "real_tokens", "padding_fraction", "samples",
           "truncated", "folded_positions")


def test_tensorboard_events_hold_the_jsonl_scalars(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    args = dict(student=tiny["student"], cache=f"[{tiny['cache']}]", micro_batch_size=2, global_batch_size=4,
                seq_length=32, train_steps=3, save_interval=3, lr=1e-3, warmup_steps=1, sft_alpha=0.5, save_dir=run,
                progress=False, prefetch=1)
    assert gkd(["train", *(f"{k}={v}" for k, v in args.items())]) == 0
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [m["step"] for m in jsonl] == [1, 2, 3]
    for name in SCALARS:
        got = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        want = {m["step"]: float(m[name]) for m in jsonl}
        assert got.keys() == want.keys(), name
        np.testing.assert_allclose(list(got.values()), np.float32(list(want.values())), rtol=1e-7, err_msg=name)
