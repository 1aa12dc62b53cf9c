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
    from pathlib import Path

    from pipeline.generate.run import GenerateConfig
    from pipeline.score.run import ScoreConfig
    from pipeline.train.run import TrainConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    for name, cls in (("score", ScoreConfig), ("generate", GenerateConfig), ("train", TrainConfig)):
        load_config(cls, root / f"{name}.yaml")
