"""On-policy cycles with a teacher of another family (another tokenizer): the driver detects it from the two
tokenizers' fingerprints, scores each cycle's student rollouts in cross-tokenizer mode and trains with loss=gold.
Checked against independent computations: each cycle's view holds exactly the round-tripping rollouts under their
cross-tokenizer content keys, with the spans and teacher tokens of the store's alignment rule, and the driver's
training equals a direct `train` of the same steps from that view.

Run: ``python -m pytest tests/onpolicy/test_onpolicy_xtok.py`` (real vLLM sampler and teacher, Megatron trainer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from onpolicy_helpers import overrides

from pipeline.config import ConfigError, load_config
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.run import run
from pipeline.onpolicy.stages import Workspace
from pipeline.store import TeacherCache, align
from pipeline.store.fingerprint import content_key, tokenizer_fingerprint
from pipeline.store.rollouts import iter_rollouts, rollout_shards


@pytest.fixture(scope="module")
def xmodels(models, tmp_path_factory) -> dict:
    """The on-policy tests' student (a byte-level BPE trained in the test) and a SmolLM2-vocabulary teacher."""
    from tiny_models import build_smollm2_tiny

    root = tmp_path_factory.mktemp("onpolicy-xtok")
    return {"teacher": build_smollm2_tiny(root / "teacher", max_pos=512), "student": models["student"],
            "root": root}


def _cfg(xmodels: dict, out: Path, **kw) -> OnPolicyConfig:
    return load_config(OnPolicyConfig, None, overrides(xmodels, out, heldout_prompts=None, **kw))


def test_a_cross_tokenizer_run_refuses_what_it_cannot_do(xmodels, tmp_path):
    with pytest.raises(ConfigError, match="held-out KL compares per-token distributions over one vocabulary"):
        Workspace.open(load_config(OnPolicyConfig, None, overrides(xmodels, tmp_path)))  # heldout_prompts set
    with pytest.raises(ConfigError, match="train.loss=gkd needs the teacher's rows in the student's tokens"):
        Workspace.open(_cfg(xmodels, tmp_path, loss="gkd"))


def test_two_cross_tokenizer_cycles(xmodels, engines, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.train.loop import train

    cfg = _cfg(xmodels, tmp_path)
    assert cfg.cross_tokenizer is None  # auto
    lines = run(cfg, engines)
    assert [m["cycle"] for m in lines] == [0, 1]
    s_tok, t_tok = (AutoTokenizer.from_pretrained(xmodels[n]) for n in ("student", "teacher"))
    cache = TeacherCache.open(tmp_path / "cache")
    d = cache.descriptor
    assert d.cross_tokenizer and d.student_tokenizer_fingerprint == tokenizer_fingerprint(s_tok)
    cross = (tokenizer_fingerprint(t_tok), tokenizer_fingerprint(s_tok))
    for c in (0, 1):
        rows = list(iter_rollouts(rollout_shards(tmp_path / "rollouts" / f"cycle-{c:04d}")))
        want = {}
        for r in rows:
            got = align.retokenize(s_tok, t_tok, r["prompt_ids"], r["completion_ids"])
            if r["completion_ids"] and not isinstance(got, str):
                ids = r["prompt_ids"] + r["completion_ids"]
                want[content_key(d.teacher_fingerprint, ids, len(r["prompt_ids"]), d.k, d.logprob_mode,
                                 cross=cross)] = (ids, got)
        view = tmp_path / "views" / f"cycle-{c:04d}"
        table = pq.read_table(view / "shards" / "view.parquet")
        print(f"cycle {c}: {len(rows)} rollouts, {len(want)} round-trip, view rows {table.num_rows}")
        assert want and sorted(table.column("key").to_pylist()) == sorted(want)
        assert (view / align.TEACHER_TOKENIZER / "tokenizer.json").exists()
        for row in table.select(["key", "student_ids", "input_ids", "span_student", "span_teacher"]).to_pylist():
            ids, got = want[row["key"]]
            assert row["student_ids"] == ids and row["input_ids"] == got.teacher_ids.tolist()
            assert np.array_equal(row["span_student"], got.span_student)
            assert np.array_equal(row["span_teacher"], got.span_teacher)
    steps = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(math.isfinite(m["jsd"]) and m["jsd"] > 0 for m in steps)
    from pipeline.train.checkpoint import latest, read_meta

    assert read_meta(latest(tmp_path / "train"))["config"]["loss"] == "gold"  # the driver's default across tokenizers
    # the driver's cycle 0 is the trainer on that view: a direct run of the same steps gives the same losses
    direct = tmp_path / "direct"
    view0 = str(tmp_path / "views" / "cycle-0000" / "shards" / "view.parquet")
    train(cfg.train_config(direct, [view0], 2, 0))
    again = [json.loads(x) for x in (direct / "metrics.jsonl").read_text().splitlines()]
    assert [m["jsd"] for m in again] == pytest.approx([m["jsd"] for m in steps[:2]], rel=1e-6)
