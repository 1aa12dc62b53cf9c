from dataclasses import dataclass, field

import pytest

from pipeline.config import ConfigError, load_config


@dataclass
class Cfg:
    lr: float = 1.0
    steps: int = 1
    name: str = "x"
    caches: list[str] = field(default_factory=list)
    maybe: int | None = None

    def validate(self):
        return ["steps must be >= 1"] if self.steps < 1 else []


def test_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nsteps: 3\n")  # 1e-4 without a dot is a string to YAML 1.1: coerced for float fields
    cfg = load_config(Cfg, path, ["caches=[a, b]", "maybe=null", "lr=1e-3"])
    assert cfg.lr == pytest.approx(1e-3) and cfg.steps == 3 and cfg.caches == ["a", "b"] and cfg.maybe is None


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, {"nope": 1, "steps": "many", "lr": "fast"})
    msg = str(e.value)
    assert "unknown key 'nope'" in msg and "steps: expected an integer" in msg and "lr: expected a number" in msg


def test_validate_runs_after_types():
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        load_config(Cfg, None, ["steps=0"])


def test_every_shipped_config_loads():
    """configs/{score,generate,train}.yaml load, and the config holds each value the file sets (read here with plain
    YAML): no key of a shipped file is dropped or coerced into another value on the way."""
    import dataclasses
    from pathlib import Path

    import yaml

    from pipeline.generate.sampler import GenerateConfig
    from pipeline.score.config import ScoreConfig
    from pipeline.train.config import TrainConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    for name, cls in (("score", ScoreConfig), ("generate", GenerateConfig), ("train", TrainConfig)):
        cfg = load_config(cls, root / f"{name}.yaml")
        raw = yaml.safe_load((root / f"{name}.yaml").read_text())
        assert raw and set(raw) <= {f.name for f in dataclasses.fields(cls)}, name
        for key, value in raw.items():
            got = getattr(cfg, key)
            # PyYAML 1.1 reads 1e-4 (no dot) as a string; the loader coerces it for float fields
            want = float(value) if isinstance(value, str) and isinstance(got, float) else value
            assert got == want, (name, key, got, value)


def test_every_shipped_recipe_loads_and_its_sections_agree():
    """configs/recipes/*.yaml: each section through its stage's real loader and validation (the score section via
    `gkd score`'s own argument parsing), and the settings that must agree across stages do."""
    from pathlib import Path

    from pipeline.onpolicy.config import load as load_onpolicy
    from pipeline.score.run import parse_args
    from pipeline.train.config import TrainConfig

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs" / "recipes").glob("*.yaml"))
    assert [p.stem for p in recipes] == ["llama3.1-8b-to-3.2-1b", "qwen2.5-7b-to-0.5b", "qwen3-8b-to-0.6b",
                                         "qwen3.5-9b-to-4b"]
    for path in recipes:
        score, _ = parse_args(["--config", str(path)])
        train = load_config(TrainConfig, path, section="train")
        onpolicy = load_onpolicy(path, [])
        assert score.cache in train.cache and onpolicy.offpolicy_cache == score.cache, path
        op_score, op_train = onpolicy.score_settings, onpolicy.train_settings
        assert score.topk == op_score.topk and score.dtype == op_score.dtype != "auto", path
        assert train.seq_length <= score.max_model_len and op_train.seq_length <= op_score.max_model_len, path
        assert "/models/" in score.teacher and "/models/" in train.student == onpolicy.student, path  # placeholders


def test_recipe_sections(tmp_path):
    from pipeline.train.config import TrainConfig

    path = tmp_path / "r.yaml"
    path.write_text("train:\n  steps: 3\nscore:\n  topk: 4\n")
    assert load_config(Cfg, path, ["lr=2"], section="train").steps == 3
    with pytest.raises(ConfigError, match=r"r.yaml \[train\]: unknown key 'steps'"):
        load_config(TrainConfig, path, section="train")
    with pytest.raises(ConfigError, match="sections train, score but no `onpolicy:` mapping"):
        load_config(Cfg, path, section="onpolicy")
    flat = tmp_path / "flat.yaml"
    flat.write_text("steps: 2\n")
    assert load_config(Cfg, flat, section="train").steps == 2  # a flat file is read as it is


def test_every_shipped_config_loads_through_its_stages_own_loader():
    """configs/*.yaml, each through the loader its command uses (argument parsing included), so validation runs as
    it does for a user; a new config file without a loader here fails the test."""
    from pathlib import Path

    from pipeline.generate.run import parse_args as generate_args
    from pipeline.onpolicy.config import load as load_onpolicy
    from pipeline.score.run import parse_args as score_args
    from pipeline.train.config import TrainConfig

    loaders = {
        "generate": lambda p: generate_args(["--config", str(p)])[0],
        "score": lambda p: score_args(["--config", str(p)])[0],
        "train": lambda p: load_config(TrainConfig, p, section="train"),
        "onpolicy": lambda p: load_onpolicy(p, []),
    }
    shipped = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert sorted(p.stem for p in shipped) == sorted(loaders)
    for path in shipped:
        cfg = loaders[path.stem](path)
        assert not cfg.validate(), path
