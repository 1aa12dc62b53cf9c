"""Several teachers routed by tag (`teachers: {TAG: CACHE}`): two tiny teachers with different weights, samples
tagged A/B, each cache scored on every sample by its teacher (a plain transformers forward, tests/tiny_cache.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_cache import build_tiny, random_samples, score_into_cache

from pipeline.store.shards import ShardError
from pipeline.train.data.loader import Routing, ScoredLoader
from pipeline.train.metrics import KD_SUM, WEIGHTED_KD_SUM, teacher_kd_count, teacher_kd_sum

N = 16


@pytest.fixture(scope="module")
def two(tiny, tmp_path_factory) -> dict:
    from pipeline.store import TeacherCache
    from pipeline.store.fingerprint import tokenizer_fingerprint

    root = tmp_path_factory.mktemp("routing")
    teacher_b = build_tiny(root / "teacher-b", seed=2)
    assert tokenizer_fingerprint(teacher_b) == tokenizer_fingerprint(tiny["model"])
    samples = random_samples(N, tiny["vocab"], seed=5)
    tags = [{"task": "A" if i % 2 else "B", "data_source": "x"} for i in range(N)]
    score_into_cache(tiny["model"], root / "a", samples, tags=tags)
    score_into_cache(teacher_b, root / "b", samples, tags=tags)
    score_into_cache(teacher_b, root / "b-only-a", [s for s, t in zip(samples, tags, strict=True) if t["task"] == "A"],
                     tags=[t for t in tags if t["task"] == "A"])
    keys = {name: TeacherCache.open(root / name).keys() for name in ("a", "b")}
    return {"root": root, "teachers": {"A": tiny["model"], "B": teacher_b}, "samples": samples, "tags": tags,
            "keys": keys, "tiny": tiny}


def _loader(two, routes, **kw):
    on_unrouted = kw.pop("on_unrouted", "error")
    return ScoredLoader(None, micro_batch_size=4, seq_length=64, seed=0, routing=Routing(routes, "task", on_unrouted),
                        **kw)


def _forward(model_dir, ids) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0], -1).numpy()


def test_each_sample_gets_the_rows_of_its_tags_teacher(two):
    root = two["root"]
    loader = _loader(two, {"A": root / "a", "B": root / "b"})
    assert loader.num_samples == N and loader.route_names == ["A", "B"]
    by_ids = {tuple(s[0].tolist()): t["task"] for s, t in zip(two["samples"], two["tags"], strict=True)}
    seen = {"A": 0, "B": 0}
    for m in range(N // 4):
        mb = loader.micro_batch(m)
        for b, key in enumerate(mb.keys):
            n = int((mb.doc_ids[b] >= 0).sum())
            ids = mb.input_ids[b, :n].numpy()
            tag = by_ids[tuple(ids.tolist())]
            assert key in two["keys"]["a" if tag == "A" else "b"]  # the row came from the tag's cache
            active = mb.loss_mask[b].nonzero().flatten()
            assert (mb.route.teacher[b, active] == loader.route_names.index(tag)).all()
            assert (mb.route.teacher[b][~mb.loss_mask[b]] == -1).all()
            own, other = (_forward(two["teachers"][t], ids) for t in (tag, "B" if tag == "A" else "A"))
            t_ids = mb.teacher_ids[b, active].long().numpy()
            got = mb.teacher_logprobs[b, active].numpy()
            # the stored rows are that teacher's forward at t (logits at t predict token t + 1), within the codec
            np.testing.assert_allclose(got, np.take_along_axis(own[active.numpy()], t_ids, 1), atol=1 / 64 + 1e-5)
            assert np.abs(got - np.take_along_axis(other[active.numpy()], t_ids, 1)).max() > 0.5  # not the other's
            seen[tag] += 1
    assert seen == {"A": N // 2, "B": N // 2}


def test_unrouted_missing_and_default_routes(two):
    root = two["root"]
    with pytest.raises(ValueError, match="have task=B, which no teacher route covers .*on_unrouted=skip"):
        _loader(two, {"A": root / "a"})
    skipped = _loader(two, {"A": root / "a"}, on_unrouted="skip")
    assert (skipped.num_samples, skipped.unrouted) == (N // 2, N // 2)
    routed = _loader(two, {"A": root / "a", "default": root / "b"})
    assert routed.num_samples == N and routed.route_names == ["A", "default"]
    with pytest.raises(ShardError, match=r"route to a teacher cache that has no row for them, e\.g\. .*\(task=B\)"):
        _loader(two, {"A": root / "a", "B": root / "b-only-a"})
    with pytest.raises(ValueError, match="no teacher route covers"):  # rows scored with no tags at all
        _loader(two, {"A": two["tiny"]["cache"]})


def test_loss_weights_each_teachers_positions(two, single_process):
    """loss = sum over teachers of w_t * KD sum on its positions / the step's count (the reference loss, unfused);
    the report holds each teacher's sum and count."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.step import loss_func

    root = two["root"]
    routes = {"A": str(root / "a"), "B": str(root / "b")}
    mb = _loader(two, routes).micro_batch(0)
    assert {0, 1} <= set(mb.route.teacher.unique().tolist())
    cfg = TrainConfig(cache=[], teachers=routes, teacher_weights={"A": 2.0, "B": 0.5}, fused_loss=False)
    logits = torch.randn(*mb.input_ids.shape, two["tiny"]["vocab"], generator=torch.Generator().manual_seed(0))
    count = float(mb.loss_mask.sum())
    loss, n, report = loss_func(mb, (count, 1.0), cfg, two["tiny"]["vocab"], None, logits)
    parts = [gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask & (mb.route.teacher == i),
                      beta=cfg.kd_beta, mode=cfg.topk_mode, teacher_tail=mb.teacher_tail,
                      teacher_valid=mb.teacher_valid) for i in (0, 1)]
    expect = (2.0 * parts[0][0] + 0.5 * parts[1][0]) / count
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=0)  # the same sums, added in the same order
    kd_a, kd_b = report[teacher_kd_sum("A")], report[teacher_kd_sum("B")]  # the named entries of train/metrics.py
    assert int(n) == count == int(report[teacher_kd_count("A")] + report[teacher_kd_count("B")])
    torch.testing.assert_close(torch.stack([kd_a, kd_b]).float(), torch.stack([parts[0][0], parts[1][0]]))
    torch.testing.assert_close(report[WEIGHTED_KD_SUM], 2.0 * kd_a + 0.5 * kd_b)
    torch.testing.assert_close(report[KD_SUM], kd_a + kd_b)


def test_trainer_reports_each_teacher(two, tmp_path):
    from pipeline.cli import main as cli

    root = two["root"]
    args = [f"student={two['tiny']['student']}", "cache=[]", f"teachers={{A: {root / 'a'}, B: {root / 'b'}}}",
            "teacher_tag_key=task", "teacher_weights={B: 0.25}", "micro_batch_size=2", "global_batch_size=4",
            "seq_length=64", "train_steps=2", "warmup_steps=0", f"save_dir={tmp_path}", "progress=false"]
    assert cli(["train", *args]) == 0
    for m in [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]:
        na, nb = m["active_tokens/A"], m["active_tokens/B"]
        assert na + nb == m["active_tokens"] and na > 0 and nb > 0
        # jsd is the plain mean over both teachers; loss weights B's part by 0.25
        assert m["jsd"] == pytest.approx((m["jsd/A"] * na + m["jsd/B"] * nb) / (na + nb), rel=1e-6)
        assert m["loss"] == pytest.approx((m["jsd/A"] * na + 0.25 * m["jsd/B"] * nb) / (na + nb), rel=1e-6)
        assert m["unrouted_samples"] == 0


@pytest.mark.parametrize("packing", [False, True])
def test_the_route_part_on_the_padded_and_the_packed_path(two, packing):
    """The loader builds the route part on both layouts: each sample's active positions hold its tag's teacher, -1
    everywhere else; `.to` moves its tensor."""
    root = two["root"]
    kw = dict(packing=True, rows_per_step=4) if packing else {}
    loader = _loader(two, {"A": root / "a", "B": root / "b"}, **kw)
    mb = loader.micro_batch(0)
    assert mb.parts() == ("route",) and mb.packed == packing
    if packing:
        assert mb.samples > mb.input_ids.shape[0]  # really several samples per row
    route = mb.route.teacher
    assert route.dtype == torch.int64 and route.shape == mb.input_ids.shape
    by_ids = {tuple(s[0].tolist()): t["task"] for s, t in zip(two["samples"], two["tags"], strict=True)}
    seen = 0
    for r in range(mb.input_ids.shape[0]):
        for d in range(int(mb.doc_ids[r].max()) + 1):
            cols = np.flatnonzero(mb.doc_ids[r].numpy() == d)
            tag = by_ids[tuple(mb.input_ids[r, cols].tolist())]
            active = cols[mb.loss_mask[r, cols].numpy()]
            assert len(active) and (route[r, active] == loader.route_names.index(tag)).all()
            seen += 1
    assert seen == mb.samples and bool((route[~mb.loss_mask] == -1).all())
    moved = mb.to("meta")
    assert moved.route.teacher.is_meta and moved.route.teacher.shape == route.shape and not route.is_meta
