"""The on-policy driver's config: its own settings, plus each stage's settings under the stage's own names.

    gkd onpolicy num_cycles=8 score.topk=64 train.lr=1e-5 generate.max_tokens=128

`generate:`, `score:` and `train:` hold GenerateConfig / ScoreConfig / TrainConfig keys; each is loaded and validated
by that stage's own loader when this config loads, so a bad `score.topk` fails before the first cycle. The stage
configs of a cycle are built here (`generate_config`, `score_config`, `train_config`): the one place that maps the
run onto its stages.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, load_config
from pipeline.generate.sampler import GenerateConfig
from pipeline.score.config import ScoreConfig
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.train.config import TrainConfig
from pipeline.train.losses.xtok import XTOK_LOSSES

STAGES = ("export", "generate", "score", "train", "eval")  # one cycle, in order; state.json names the next one
EXECUTORS = ("local", "slurm", "ray")
WEIGHT_SYNCS = ("reload", "restart")
# Trainer keys that split the model across processes: the on-policy trainer is one process
ONE_PROCESS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size")
STAGE_CLASSES = {"generate": GenerateConfig, "score": ScoreConfig, "train": TrainConfig}
# Where an on-policy run starts from other values than the stage's own defaults, and why: short samples
# (max_tokens 64, sequences of 512 tokens), both vLLM engines beside the trainer in one process (small KV caches,
# eager mode: no graph capture per cycle), the deterministic fp32 sampler, and small batches (a cycle is a few steps).
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "generate": {"n": 2, "max_tokens": 64, "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.5,
                 "enforce_eager": True},
    "score": {"topk": 16, "max_model_len": 512, "kv_cache_gib": 0.5, "enforce_eager": True},
    "train": {"micro_batch_size": 4, "global_batch_size": 8, "warmup_steps": 1},
}
# Stage keys the driver sets itself, per cycle or per task, with where each comes from: a stage section naming one
# is refused at load (it would be overwritten silently otherwise).
DRIVER_SET: dict[str, dict[str, str]] = {
    "generate": {"prompts": "prompts", "teacher_prompt_field": "teacher_prompt_field", "student": "student",
                 "out": "out (OUT/rollouts/<cycle>)", "shard": "the task", "num_shards": "slurm_generate_shards",
                 "seed": "generate_seed / seed + cycle", "policy_version": "the trainer step",
                 "on_bad_prompt": "always skip (a cycle does not stop on one bad prompt)"},
    "score": {"rollouts": "the cycle's rollouts", "cache": "cache / offpolicy_cache", "teacher": "teacher",
              "cross_tokenizer": "cross_tokenizer", "student_tokenizer": "student (cross_tokenizer)",
              "shard": "the task", "num_shards": "slurm_score_shards",
              "on_overlong": "always skip (a cycle does not stop on one overlong sample)"},
    "train": {"student": "student", "cache": "the cycle's view", "seed": "seed", "train_steps":
              "num_cycles x steps_per_generation", "save_dir": "out (OUT/train)", "save_interval":
              "steps_per_generation", "exit_after": "the cycle's end", "data_position": "the cycle's view",
              "progress": "progress"},
}


@dataclass
class OnPolicyConfig:
    out: str = "runs/onpolicy"  # state.json, metrics.jsonl, rollouts/, views/, train/, exports/
    executor: str = "local"
    student: str = "default"  # HF folder; "default" = the SmolLM2 6-layer student (pipeline.assets)
    teacher: str = "default"  # HF folder; "default" = SmolLM2-135M-Instruct
    cache: str = "runs/onpolicy/cache"  # teacher cache the student rollouts are scored into (shareable, incremental)
    # A teacher with another tokenizer (docs/architecture.md, "Cross-tokenizer distillation"): the score stage
    # aligns the student's rollouts to the teacher's tokens (score.cross_tokenizer) and the trainer uses
    # loss=gold (or train.loss=uld). null: decided when the run opens (Workspace.open), by comparing the two
    # tokenizers' fingerprints (store/fingerprint.py); true/false: forced.
    cross_tokenizer: bool | None = None
    # -- schedule
    num_cycles: int = 4
    steps_per_generation: int = 2
    lmbda: float = 0.5  # probability that a cycle is on-policy, drawn from random.Random(seed + step)
    # Overlapped cycles (cycle.py): cycle c is sampled with the weights of cycle c - max_staleness, so the sampler
    # and the teacher work on the next cycles while the trainer trains this one. 0: the strict order, one stage at
    # a time. Forward-KL / JSD losses accept N >= 1; OPD (the sampled tokens' reverse KL) is refused (docs/tuning.md).
    max_staleness: int = 0
    seed: int = 1234  # lmbda draws, trainer seed, sampling seeds
    # -- on-policy sampling (the sampling settings themselves are generate's: `generate:` below)
    prompts: str = "reasoning-gym:basic_arithmetic?size=64&seed=0"
    # OPSD: a text/chat field of `prompts` the teacher sees instead of the prompt (the student samples from its
    # prompt, the teacher scores teacher prompt + completion); null: the teacher sees the student's prompt
    teacher_prompt_field: str | None = None
    prompts_per_cycle: int = 8  # cycle c samples prompts [c*ppc, (c+1)*ppc) of the source, wrapping around
    generate_seed: int | None = None  # null: seed + cycle (fresh samples each cycle); a number: that seed always
    weight_sync: str = "reload"  # reload: in-place into the running sampler; restart: a fresh engine per cycle
    # -- off-policy data: an existing cache, or built once from a dataset's reference responses
    offpolicy_cache: str | None = None
    offpolicy_dataset: str | None = None  # e.g. reasoning-gym:basic_arithmetic?size=64&seed=1 (imported + scored)
    # -- held-out KL(teacher || student) on student samples (generated once by the initial student, scored)
    heldout_prompts: str | None = None
    heldout_n: int = 1
    # -- the stages' own settings under their own names and validation (GenerateConfig, ScoreConfig, TrainConfig),
    # over STAGE_DEFAULTS; e.g. `score: {topk: 64}` or `train.lr=1e-5`. Keys the driver sets itself (DRIVER_SET)
    # are refused.
    generate: dict = field(default_factory=dict)
    score: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    # -- executor=slurm: each cycle's stages as dependent jobs (pipeline/onpolicy/slurm.py); sbatch options apply
    # to every job (export, generate and score tasks, train); null leaves the cluster's default
    slurm_partition: str | None = None
    slurm_time: str | int | None = None  # per job, e.g. "2:00:00" (quoted: YAML reads 2:00:00 as 7200)
    slurm_cpus_per_task: int | None = None  # also sets OMP_NUM_THREADS in the job
    slurm_mem: str | None = None  # e.g. "64G"
    slurm_gres: str | None = None  # e.g. "gpu:1"
    slurm_extra: str = ""  # more sbatch options, e.g. "--account=proj --qos=high"
    slurm_generate_shards: int = 2  # tasks of the generate array (prompts split by a hash of their id)
    slurm_score_shards: int = 2  # tasks of the score array (rollouts split by a hash of their content key)
    slurm_log_dir: str | None = None  # scripts and job logs; null: OUT/slurm/logs
    slurm_poll_s: float = 5.0  # squeue polling interval of the driver
    slurm_stage_timeout_s: float | None = None  # give up waiting for one stage's jobs after this long; null: never
    # -- executor=ray: sampler, teacher and trainer as long-lived Ray actors (pipeline/onpolicy/ray.py)
    ray_address: str = "local"  # local (a single-machine cluster of our own), auto, HOST:PORT or ray://HOST:PORT
    ray_num_cpus: float = 1.0  # per actor (and its torch threads); the three reserve this much each
    ray_num_gpus: float = 0.0  # per actor, e.g. 1: the sampler, the teacher and the trainer each on a GPU
    # -- run control
    progress: bool = True
    stop_after: str | None = None  # "CYCLE:STAGE": exit once that stage is done (tests, debugging)

    def validate(self) -> list[str]:
        p = []
        if self.executor not in EXECUTORS:
            p.append(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.weight_sync not in WEIGHT_SYNCS:
            p.append(f"weight_sync must be one of {WEIGHT_SYNCS}, got {self.weight_sync!r}")
        if not 0.0 <= self.lmbda <= 1.0:
            p.append("lmbda must be in [0, 1]")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            p.append(f"max_staleness must be an integer >= 0 (0: strict cycles), got {self.max_staleness!r}")
        for name in ("num_cycles", "steps_per_generation", "prompts_per_cycle", "heldout_n"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1")
        if self.lmbda < 1.0 and not (self.offpolicy_cache or self.offpolicy_dataset):
            p.append("lmbda < 1 needs off-policy data: offpolicy_cache (an existing cache) and/or offpolicy_dataset")
        if self.offpolicy_dataset and not self.offpolicy_cache:
            p.append("offpolicy_dataset needs offpolicy_cache: the directory it is scored into")
        p += self._slurm_problems()
        if self.ray_num_cpus <= 0 or self.ray_num_gpus < 0:
            p.append("ray_num_cpus must be > 0 and ray_num_gpus >= 0")
        if self.stop_after is not None:
            cycle, _, stage = self.stop_after.partition(":")
            if not cycle.isdigit() or stage not in STAGES:
                p.append(f"stop_after: 'CYCLE:STAGE' with STAGE in {STAGES}, got {self.stop_after!r}")
        stage_problems = self._stage_problems()
        if stage_problems:
            return p + stage_problems
        gen, sc, tr = self.generate_settings, self.score_settings, self.train_settings
        p += self.cross_problems()
        if self.opd_weighted is False:
            p.append(f"max_staleness={self.max_staleness} with train.loss=opd and train.opd_is_cap=null: the "
                     "sampled-token reverse KL trains on the sampler's own tokens, so samples of older weights bias "
                     "it without its importance weights; set train.opd_is_cap (e.g. 2), or max_staleness=0")
        if sc.topk == 0 and tr.loss != "opd":
            p.append("score.topk=0 stores no teacher top-k: only train.loss=opd can train from it")
        if sc.hidden and self.heldout_prompts:
            p.append("score.teacher_rows=hidden: the held-out KL reads the teacher's top-k rows, which a hidden-state "
                     "cache does not hold; set heldout_prompts: null (the trainer's metrics.jsonl logs the exact "
                     "divergence of every step), or score.teacher_rows=topk")
        if sc.topk == 0 and self.heldout_prompts:
            p.append("score.topk=0: the held-out KL needs the teacher's top-k; set heldout_prompts: null (or topk >= 1)")
        if gen.max_model_len is not None and gen.max_tokens >= gen.max_model_len:
            p.append("generate.max_tokens must be < generate.max_model_len (the prompt needs room)")
        return p

    def cross_problems(self) -> list[str]:
        """What a cross-tokenizer run (cross_tokenizer true, set or detected) cannot do; [] otherwise."""
        if not self.cross_tokenizer:
            return []
        p = []
        if self.train_settings.loss not in XTOK_LOSSES:
            p.append(f"the teacher has another tokenizer than the student (cross_tokenizer): train.loss="
                     f"{self.train_settings.loss} needs the teacher's rows in the student's tokens; use train.loss=gold "
                     "(the default here) or train.loss=uld")
        if self.heldout_prompts:
            p.append("the teacher has another tokenizer than the student (cross_tokenizer): the held-out KL compares "
                     "per-token distributions over one vocabulary; set heldout_prompts: null")
        if self.teacher_prompt_field:
            p.append("the teacher has another tokenizer than the student (cross_tokenizer): a privileged teacher "
                     "prompt (teacher_prompt_field) is scored in the teacher's own tokens only; drop it")
        return p

    def decide_cross_tokenizer(self, student: Path, teacher: Path) -> None:
        """cross_tokenizer=null: true iff the two tokenizers' fingerprints differ (the store's one rule); the stage
        settings are rebuilt and the cross-tokenizer limits checked (ConfigError) before any cycle."""
        self._student_dir = str(student)
        if self.cross_tokenizer is None:
            self.cross_tokenizer = tokenizer_fingerprint(student) != tokenizer_fingerprint(teacher)
            for name in ("score_settings", "train_settings"):
                self.__dict__.pop(name, None)  # computed before the decision
        if problems := self.cross_problems():
            raise ConfigError("; ".join(problems))

    @classmethod
    def key_hint(cls, key: str) -> str | None:
        """For an unknown top-level key: the stage section it belongs in (pipeline.config reports it)."""
        name = key.removeprefix("kd_")  # kd_temperature: the old flat name of train.temperature
        stages = [s for s, c in STAGE_CLASSES.items() if name in {f.name for f in fields(c)}
                  and (key == name or s == "train")]
        if not stages:
            return None
        return f"a stage setting goes under its stage: {' or '.join(f'{s}.{name}' for s in stages)}"

    def _slurm_problems(self) -> list[str]:
        p = []
        for name in ("slurm_generate_shards", "slurm_score_shards"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1")
        if self.slurm_cpus_per_task is not None and self.slurm_cpus_per_task < 1:
            p.append("slurm_cpus_per_task must be >= 1 (or null)")
        if self.slurm_poll_s <= 0:
            p.append("slurm_poll_s must be > 0")
        if isinstance(self.slurm_time, int):  # YAML 1.1 reads 2:00:00 as the number 7200 (seconds)
            p.append(f"slurm_time: got the number {self.slurm_time}; write the time as a string, e.g. "
                     "\"slurm_time='2:00:00'\" on the command line or slurm_time: \"2:00:00\" in a file")
        try:
            extra = shlex.split(self.slurm_extra)
        except ValueError as e:
            return [*p, f"slurm_extra: cannot split {self.slurm_extra!r} into options ({e})"]
        owned = ("--array", "--dependency", "--job-name", "--output", "--error", "--chdir", "--parsable", "-a", "-d",
                 "-J", "-o", "-e", "-D")
        clash = [o for o in extra if o.split("=", 1)[0] in owned]
        if clash:
            p.append(f"slurm_extra must not set {', '.join(clash)}: the driver sets job names, arrays, dependencies, "
                     "logs and the working directory itself")
        loose = [o for o in extra if not o.startswith("-")]
        if loose:
            p.append(f"slurm_extra: {', '.join(loose)} is not an option; write options as --name=value")
        return p

    def _stage_problems(self) -> list[str]:
        """Each stage section through its stage's own loader and validation, so a bad value fails at load."""
        p = []
        for stage in STAGE_CLASSES:
            owned = {k: DRIVER_SET[stage][flat] for k in getattr(self, stage)
                     if (flat := k.replace(".", "_")) in DRIVER_SET[stage]}
            if owned:
                p += [f"{stage}.{k} is set by the on-policy driver (from {source}); remove it"
                      for k, source in sorted(owned.items())]
                continue
            if stage == "train":  # the trainer runs in its stage's one process (or actor, or job), never torchrun
                split = {k: v for k in ONE_PROCESS if str(v := self.train.get(k, 1)) not in ("1", "None")}
                if split:
                    p += [f"train.{k}={v}: the on-policy trainer runs in one process (no torchrun), so it cannot be "
                          f"split across processes; remove train.{k} (or set it to 1)" for k, v in split.items()]
                    continue
            try:
                getattr(self, f"{stage}_settings")
            except ConfigError as e:
                p.append(f"{stage}: {str(e).removeprefix('defaults: ')}")
        return p

    def stage_values(self, stage: str) -> dict[str, Any]:
        """A stage's settings for this run: STAGE_DEFAULTS under the run's own section."""
        return {**STAGE_DEFAULTS[stage], **getattr(self, stage)}

    # The stage settings the driver reads itself (the sampler's LoRA rank, the teacher's k, ...), as typed stage
    # configs; the paths, seeds and shards in them are placeholders the cycle's config replaces.
    @functools.cached_property
    def generate_settings(self) -> GenerateConfig:
        return self.generate_config(Path(self.out), self.student, 0, self.seed)

    @functools.cached_property
    def score_settings(self) -> ScoreConfig:
        return self.score_config(Path(self.out), self.cache)

    @functools.cached_property
    def train_settings(self) -> TrainConfig:
        return self.train_config(Path(self.out) / "train", [self.cache], self.steps_per_generation, None)

    @property
    def total_steps(self) -> int:
        return self.num_cycles * self.steps_per_generation

    @property
    def opd_weighted(self) -> bool | None:
        """loss=opd on stale samples: whether its importance weights apply (the sampler then records its logprobs,
        which the cache keeps for the trainer); None where the question does not arise (strict cycles, another
        loss): those runs record nothing extra, so they stay what they were."""
        if not (isinstance(self.max_staleness, int) and self.max_staleness > 0 and self.train_settings.loss == "opd"):
            return None
        return self.train_settings.opd_is_cap is not None

    # -- stage configs ----------------------------------------------------------------------------------------
    def generate_config(self, out: Path, student: str, policy_version: int, seed: int) -> GenerateConfig:
        return load_config(GenerateConfig, None, {
            **self.stage_values("generate"), "prompts": self.prompts, "teacher_prompt_field": self.teacher_prompt_field,
            "student": student, "out": str(out), "num_shards": 1, "shard": 0, "seed": seed,
            "policy_version": policy_version, "on_bad_prompt": "skip", **({"logprobs": True} if self.opd_weighted else {})})

    def score_config(self, rollouts: Path, cache: str) -> ScoreConfig:
        cross = {}
        if self.cross_tokenizer:  # the rollouts' tokenizer is the student's (resolved by decide_cross_tokenizer)
            cross = {"cross_tokenizer": True, "student_tokenizer": getattr(self, "_student_dir", self.student)}
        return load_config(ScoreConfig, None, {
            **self.stage_values("score"), "rollouts": str(rollouts), "cache": cache, "teacher": self.teacher,
            "shard": 0, "num_shards": 1, "on_overlong": "skip", **cross})

    def train_config(self, save_dir: Path, sources: list[str], exit_after: int | None,
                     data_position: int | None) -> TrainConfig:
        """The trainer of the whole run: train_steps is the run's total (so the LR schedule is that of one long
        run), and each cycle stops after its steps_per_generation with `exit_after` (a checkpoint at each end).
        The trainer runs in the stage's one process (no torchrun): validated for a world of 1."""
        values = self.stage_values("train")
        if self.cross_tokenizer and "loss" not in values:  # a teacher with another tokenizer: GOLD by default
            values["loss"] = "gold"
        return load_config(TrainConfig, None, {
            **values, "student": self.student, "cache": list(sources), "seed": self.seed,
            "train_steps": self.total_steps, "save_dir": str(save_dir), "save_interval": self.steps_per_generation,
            "exit_after": exit_after, "data_position": data_position, "progress": False})


def load(path: str | Path | None, overrides: list[str]) -> OnPolicyConfig:
    return load_config(OnPolicyConfig, path, overrides, section="onpolicy")
