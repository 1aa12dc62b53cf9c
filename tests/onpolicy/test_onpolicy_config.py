"""The on-policy config: the driver's settings plus each stage's own keys, checked by the stage's loader at load."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.generate.sampler import GenerateConfig
from pipeline.onpolicy.config import DRIVER_SET, STAGE_DEFAULTS, OnPolicyConfig, load
from pipeline.score.config import ScoreConfig
from pipeline.train.config import TrainConfig

BASE = ["lmbda=1"]  # lmbda < 1 needs off-policy data; not what these tests are about


def test_stage_keys_reach_the_stage_configs_under_their_own_names(tmp_path):
    cfg = load(None, [*BASE, "score.topk=64", "train.lr=1e-5", "train.lora.rank=8", "generate.max_tokens=32"])
    assert cfg.score_settings.topk == 64 and cfg.train_settings.lr == 1e-5 and cfg.train_settings.lora_rank == 8
    assert cfg.generate_settings.max_tokens == 32
    # the cycle's configs carry them, with the driver's own values beside them
    tcfg = cfg.train_config(tmp_path / "train", ["c"], 2, None)
    assert (tcfg.lr, tcfg.train_steps, tcfg.save_interval, tcfg.progress) == (1e-5, cfg.total_steps, 2, False)
    scfg = cfg.score_config(tmp_path / "r", "cache")
    assert (scfg.topk, scfg.on_overlong, scfg.num_shards) == (64, "skip", 1)


def test_a_file_section_is_merged_with_dotted_overrides(tmp_path):
    path = tmp_path / "op.yaml"
    path.write_text("lmbda: 1\nscore:\n  topk: 32\n  batch_tokens: 4096\ntrain:\n  lr: 0.01\n")
    cfg = load(path, ["score.topk=8"])
    assert cfg.score == {"topk": 8, "batch_tokens": 4096}  # one key replaced, the other kept
    assert cfg.score_settings.batch_tokens == 4096 and cfg.train_settings.lr == 0.01


def test_unset_stage_keys_are_the_on_policy_defaults_then_the_stages_own():
    cfg = load(None, BASE)
    for stage, values in STAGE_DEFAULTS.items():
        settings = getattr(cfg, f"{stage}_settings")
        assert all(getattr(settings, k) == v for k, v in values.items()), stage
    assert cfg.train_settings.beta == TrainConfig().beta and cfg.score_settings.dtype == ScoreConfig().dtype
    assert cfg.generate_settings.top_p == GenerateConfig().top_p


@pytest.mark.parametrize("override, words", [
    ("score.topk=-1", ("score:", "topk")),                       # the score stage's own validation, at load
    ("train.global_batch_size=3", ("train:", "global_batch_size")),
    ("generate.n=0", ("generate:", "n")),
    ("train.bogus=1", ("train:", "unknown key 'bogus'")),
    ("train.save_dir=x", ("train.save_dir is set by the on-policy driver",)),
    ("score.rollouts=x", ("score.rollouts is set by the on-policy driver",)),
    ("topk=8", ("unknown key 'topk'", "score.topk")),             # an old flat key names its section
    ("kd_temperature=2", ("unknown key 'kd_temperature'", "train.temperature")),
    ("score.topk=0", ("only train.loss=opd",)),
    ("score.teacher_rows=hidden heldout_prompts=p.jsonl", ("the held-out KL reads the teacher's top-k rows", "heldout_prompts: null")),
    ("generate.max_tokens=512", ("generate.max_tokens must be < generate.max_model_len",)),
])
def test_bad_stage_settings_fail_at_load(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(OnPolicyConfig, None, [*BASE, *override.split()])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_driver_set_keys_are_stage_keys():
    """A DRIVER_SET entry that is not a key of its stage would refuse nothing: keep the table true."""
    from dataclasses import fields

    for stage, cls in (("generate", GenerateConfig), ("score", ScoreConfig), ("train", TrainConfig)):
        assert set(DRIVER_SET[stage]) <= {f.name for f in fields(cls)}, stage
        assert not set(STAGE_DEFAULTS[stage]) & set(DRIVER_SET[stage]), stage
