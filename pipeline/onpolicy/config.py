"""The on-policy driver's flat config, and the stage configs derived from it (one place maps knobs to stages)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ConfigError, load_config
from pipeline.generate.sampler import GenerateConfig
from pipeline.score.scorer import ScoreConfig
from pipeline.train.trainer import TrainConfig

STAGES = ("export", "generate", "score", "train", "eval")  # one cycle, in order; state.json names the next one
EXECUTORS = ("local", "slurm")
WEIGHT_SYNCS = ("reload", "restart")


@dataclass
class OnPolicyConfig:
    out: str = "runs/onpolicy"  # state.json, metrics.jsonl, rollouts/, views/, train/, exports/
    executor: str = "local"
    student: str = "default"  # HF folder; "default" = the SmolLM2 6-layer student (pipeline.assets)
    teacher: str = "default"  # HF folder; "default" = SmolLM2-135M-Instruct
    cache: str = "runs/onpolicy/cache"  # teacher cache the student rollouts are scored into (shareable, incremental)
    # -- schedule
    num_cycles: int = 4
    steps_per_generation: int = 2
    lmbda: float = 0.5  # probability that a cycle is on-policy, drawn from random.Random(seed + step)
    seed: int = 1234  # lmbda draws, trainer seed, sampling seeds
    # -- on-policy sampling
    prompts: str = "reasoning-gym:basic_arithmetic?size=64&seed=0"
    # OPSD: a text/chat field of `prompts` the teacher sees instead of the prompt (the student samples from its
    # prompt, the teacher scores teacher prompt + completion); null: the teacher sees the student's prompt
    teacher_prompt_field: str | None = None
    prompts_per_cycle: int = 8  # cycle c samples prompts [c*ppc, (c+1)*ppc) of the source, wrapping around
    n: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    generate_seed: int | None = None  # null: seed + cycle (fresh samples each cycle); a number: that seed always
    weight_sync: str = "reload"  # reload: in-place into the running sampler; restart: a fresh engine per cycle
    # -- off-policy data: an existing cache, or built once from a dataset's reference responses
    offpolicy_cache: str | None = None
    offpolicy_dataset: str | None = None  # e.g. reasoning-gym:basic_arithmetic?size=64&seed=1 (imported + scored)
    # -- held-out KL(teacher || student) on student samples (generated once by the initial student, scored)
    heldout_prompts: str | None = None
    heldout_n: int = 1
    # -- teacher / engines
    topk: int = 16  # 0: only the sampled tokens' teacher logprobs (loss=opd; no held-out KL then)
    topp: float | None = None  # variable k (score stage `topp`/`min_k`, topk the cap); null: fixed k
    min_k: int | None = None
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_gib: float = 0.5
    enforce_eager: bool = True
    batch_tokens: int = 8192
    # -- trainer
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 512
    lr: float = 1.0e-4
    min_lr: float = 1.0e-5
    warmup_steps: int = 1
    clip_grad: float = 1.0
    beta: float = 0.5
    kd_temperature: float = 1.0
    topk_mode: str = "tail"
    loss: str = "gkd"  # gkd | opd: the trainer's loss (TrainConfig.loss; opd = sampled-token on-policy distillation)
    sft_alpha: float = 0.0
    train_extra: dict = field(default_factory=dict)  # any other TrainConfig key, e.g. {window_rows: 1024}
    # -- LoRA student: lora_rank > 0 trains adapters on the frozen student, and each cycle ships only the adapter
    # to the sampler (peft folder + a new LoRARequest) instead of reloading full weights
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
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
        for name in ("num_cycles", "steps_per_generation", "prompts_per_cycle", "n", "max_tokens", "heldout_n"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1")
        if self.lmbda < 1.0 and not (self.offpolicy_cache or self.offpolicy_dataset):
            p.append("lmbda < 1 needs off-policy data: offpolicy_cache (an existing cache) and/or offpolicy_dataset")
        if self.offpolicy_dataset and not self.offpolicy_cache:
            p.append("offpolicy_dataset needs offpolicy_cache: the directory it is scored into")
        if self.topk == 0 and self.loss != "opd":
            p.append("topk=0 stores no teacher top-k: only loss=opd can train from it")
        if self.topk == 0 and self.heldout_prompts:
            p.append("topk=0: the held-out KL needs the teacher's top-k; set heldout_prompts: null (or topk >= 1)")
        if self.max_tokens >= self.max_model_len:
            p.append("max_tokens must be < max_model_len (the prompt needs room)")
        p += self._slurm_problems()
        if self.stop_after is not None:
            cycle, _, stage = self.stop_after.partition(":")
            if not cycle.isdigit() or stage not in STAGES:
                p.append(f"stop_after: 'CYCLE:STAGE' with STAGE in {STAGES}, got {self.stop_after!r}")
        return p + self._stage_problems()

    def _slurm_problems(self) -> list[str]:
        import shlex

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
        """Build every stage config once, so a bad value is reported at load, not cycles later."""
        try:
            self.train_config(Path("."), [self.cache], self.steps_per_generation, None)
        except (ConfigError, TypeError) as e:
            return [f"trainer: {e}"]
        return [f"scorer: {e}" for e in self.score_config(Path("."), self.cache).validate()]

    @property
    def total_steps(self) -> int:
        return self.num_cycles * self.steps_per_generation

    # -- stage configs ----------------------------------------------------------------------------------------
    def generate_config(self, out: Path, student: str, policy_version: int, seed: int) -> GenerateConfig:
        return GenerateConfig(
            prompts=self.prompts, teacher_prompt_field=self.teacher_prompt_field, student=student, out=str(out),
            num_shards=1, shard=0, n=self.n,
            temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, seed=seed,
            policy_version=policy_version, on_bad_prompt="skip", dtype=self.dtype, max_model_len=self.max_model_len,
            kv_cache_gib=self.kv_cache_gib, enforce_eager=self.enforce_eager,
        )

    def score_config(self, rollouts: Path, cache: str) -> ScoreConfig:
        return ScoreConfig(
            rollouts=str(rollouts), cache=cache, teacher=self.teacher, topk=self.topk, topp=self.topp,
            min_k=self.min_k, shard=0, num_shards=1,
            on_overlong="skip", dtype=self.dtype, max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
            enforce_eager=self.enforce_eager, batch_tokens=self.batch_tokens,
        )

    def train_config(self, save_dir: Path, sources: list[str], exit_after: int | None,
                     data_position: int | None) -> TrainConfig:
        """The trainer of the whole run: train_steps is the run's total (so the LR schedule is that of one long
        run), and each cycle stops after its steps_per_generation with `exit_after` (a checkpoint at each end)."""
        values = {
            "student": self.student, "cache": list(sources), "seed": self.seed,
            "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length, "train_steps": self.total_steps, "lr": self.lr, "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps, "clip_grad": self.clip_grad, "beta": self.beta,
            "temperature": self.kd_temperature, "topk_mode": self.topk_mode, "loss": self.loss, "sft_alpha": self.sft_alpha,
            "save_dir": str(save_dir), "save_interval": self.steps_per_generation, "exit_after": exit_after,
            "data_position": data_position, "progress": False, "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha, "lora_targets": list(self.lora_targets), **self.train_extra,
        }
        return load_config(TrainConfig, None, values)


def load(path: str | Path | None, overrides: list[str]) -> OnPolicyConfig:
    return load_config(OnPolicyConfig, path, overrides, section="onpolicy")
