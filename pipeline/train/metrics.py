"""What a train step reports, in one place: the loss's named report entries, their sum over micro-batches and ranks,
and the step's metrics derived from them.

Megatron's contract for a loss function is (loss, token count, {name: tensor}): the forward-backward schedule hands
back one such dict per micro-batch. `step.loss_func` fills these entries (float64 0-d tensors, sums over the
micro-batch's active positions); `sum_reports` adds them over micro-batches and ranks by name; `step_row`
turns them and the step's counts into the metrics.jsonl row, `log_row` writes it. A new entry is a new name here, read by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.store.shards import WriteError

if TYPE_CHECKING:
    from pipeline.train.config import TrainConfig

# One loss call's sums (`step._loss_terms`): the divergence over KD positions, SFT cross-entropy over the
# dataset-sourced ones, loss=opd's estimator and its KL over the student-sourced ones.
KD_SUM, SFT_SUM, OPD_SUM, OPD_KL_SUM = "kd_sum", "sft_sum", "opd_sum", "opd_kl_sum"
TERMS = (KD_SUM, SFT_SUM, OPD_SUM, OPD_KL_SUM)
# The KD sum with each routed teacher's teacher_weights applied (= kd_sum without routing or weights).
WEIGHTED_KD_SUM = "weighted_kd_sum"


def teacher_kd_sum(name: str) -> str:
    """The entry of routed teacher `name`'s KD sum (its positions only)."""
    return f"kd_sum/{name}"


def teacher_kd_count(name: str) -> str:
    """The entry of routed teacher `name`'s active KD positions."""
    return f"kd_count/{name}"


def terms(kd: Tensor, sft: Tensor, opd: Tensor, opd_kl: Tensor) -> dict[str, Tensor]:
    """One loss call's sums as named entries, detached, float64."""
    return {name: x.detach().double() for name, x in zip(TERMS, (kd, sft, opd, opd_kl), strict=True)}


def sum_reports(reports: list[dict[str, Tensor]], group: dist.ProcessGroup | None = None,
                reduce: bool = True) -> dict[str, Tensor]:
    """The entries of every micro-batch's report summed by name, then (`reduce`) over the ranks of `group` in one
    all-reduce. Every report of a step has the same names (loss_func writes every routed teacher's, zero where
    absent)."""
    names = list(reports[0])
    total = torch.stack([torch.stack([r[n].reshape(()) for n in names]) for r in reports]).sum(0)
    if reduce:
        dist.all_reduce(total, group=group)
    return dict(zip(names, total.unbind(), strict=True))


def report_names(cfg: TrainConfig) -> list[str]:
    """The entries every report of a step of `cfg` has (`step.loss_func`), in one fixed order."""
    names = [*TERMS, WEIGHTED_KD_SUM]
    for name in sorted(cfg.teachers):
        names += [teacher_kd_sum(name), teacher_kd_count(name)]
    return names


def pipeline_sums(reports: list[dict[str, Tensor]], names: list[str], group: dist.ProcessGroup | None,
                  pipeline_group: dist.ProcessGroup, last_rank: int, device: torch.device) -> dict[str, Tensor]:
    """`sum_reports` under pipeline parallelism: only the last stage runs the loss (the schedule hands the other
    stages no reports), so it sums them over `group` (its data-parallel ranks) and broadcasts the sums over
    `pipeline_group` from global rank `last_rank`, and every stage reports the same step. One stage: sum_reports."""
    if dist.get_world_size(pipeline_group) == 1:
        return sum_reports(reports, group)
    if reports:
        summed = sum_reports(reports, group)
        total = torch.stack([summed[n].reshape(()).double() for n in names]).to(device)
    else:
        total = torch.zeros(len(names), dtype=torch.float64, device=device)
    dist.broadcast(total, src=last_rank, group=pipeline_group)
    return dict(zip(names, total.unbind(), strict=True))


def staleness(micro: list, weights_step: int, group: dist.ProcessGroup | None, device: torch.device) -> dict | None:
    """How far behind the trained weights the step's student rollouts were sampled, over every data-parallel rank:
    min / mean / max of `weights_step` (the optimizer steps the weights of this update have taken) minus each
    sample's policy_version (the step of the weights that sampled it). None when no sample records a version
    (dataset rows, imports). On-policy with max_staleness=N, the first step of cycle c reads N cycles' steps."""
    versions = [v for b in micro for v in b.policy_versions]
    most = torch.tensor([-min(versions, default=2**53), max(versions, default=-(2**53))], dtype=torch.float64,
                        device=device)
    total = torch.tensor([float(sum(versions)), float(len(versions))], dtype=torch.float64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(total, group=group)
    if total[1].item() == 0:
        return None
    return {"min": weights_step - int(most[1].item()), "mean": weights_step - total[0].item() / total[1].item(),
            "max": weights_step + int(most[0].item())}


def step_row(cfg: TrainConfig, step: int, sums: dict[str, Tensor], counts: Tensor, *, lr: float, grad_norm,
             seconds: float, position: int, state_bytes: int | None, unrouted: int,
             stale: dict | None = None) -> dict:
    """The step's metrics.jsonl row from the summed entries and its global counts [KD, SFT, real tokens, positions,
    samples, truncated, folded]: per-token means over the counts the loss was normalised by; with routed teachers,
    each one's mean divergence and its active positions. `state_bytes`: the Megatron optimizer's (None: hf)."""
    kd_n, sft_n = counts[0].item(), counts[1].item()
    jsd = (sums[KD_SUM] / max(kd_n, 1.0)).item()
    sft = (sums[SFT_SUM] / max(sft_n, 1.0)).item()
    opd = (sums[OPD_SUM] / max(kd_n, 1.0)).item()
    # loss=opd: student-sourced positions = all loss positions minus the dataset-sourced ones
    opd_kl = (sums[OPD_KL_SUM] / max(kd_n - sft_n, 1.0)).item()
    kd_loss = (sums[WEIGHTED_KD_SUM] / max(kd_n, 1.0)).item()  # = jsd unless teacher_weights are set
    positions, samples, truncated, folded = (int(c) for c in counts[3:].tolist())
    row = {"step": step, "loss": cfg.kd_alpha * kd_loss + opd + cfg.sft_alpha * sft, "jsd": jsd, "sft": sft,
           **({"opd": opd, "opd_kl": opd_kl} if cfg.loss == "opd" else {}),
           "lr": lr, "grad_norm": float(grad_norm or 0.0),
           "tokens_per_s": counts[2].item() / seconds, "step_seconds": seconds, "active_tokens": int(kd_n),
           "real_tokens": int(counts[2].item()), "padding_fraction": 1.0 - counts[2].item() / positions,
           "samples": samples, "truncated": truncated, "folded_positions": folded,
           "data_position": position,
           **({"optimizer_state_bytes": state_bytes} if state_bytes is not None else {}),
           **({"staleness": stale} if stale is not None else {})}
    if cfg.teachers:  # per teacher: its mean divergence and its active positions (a sum over ranks)
        for name in sorted(cfg.teachers):
            n = sums[teacher_kd_count(name)].item()
            row[f"jsd/{name}"] = sums[teacher_kd_sum(name)].item() / n if n else None
            row[f"active_tokens/{name}"] = int(n)
        row["unrouted_samples"] = unrouted
    return row


def open_sinks(log_dir: Path, step: int, train_steps: int, progress: bool) -> tuple:
    """Rank 0's (TensorBoard writer, metrics.jsonl opened to append, progress bar) from `step` on (TensorBoard
    purges the events of later steps, a resumed run redoes them)."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    log_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(log_dir / "tb"), purge_step=step)
    metrics_file = open(log_dir / "metrics.jsonl", "a")  # noqa: SIM115 - the caller closes it (its finally)
    bar = tqdm(total=train_steps, initial=step, disable=not progress, desc="train", dynamic_ncols=True)
    return writer, metrics_file, bar


# The row's entries drawn in TensorBoard (besides every per-teacher one)
SCALARS = ("loss", "jsd", "sft", "lr", "grad_norm", "tokens_per_s", "real_tokens", "padding_fraction", "samples",
           "truncated", "folded_positions", "opd_kl")


def log_row(row: dict, metrics_file, writer, bar, path: Path) -> None:
    """Rank 0: the row appended to metrics.jsonl (`path`), its scalars to TensorBoard, the progress bar moved."""
    step = row["step"]
    try:
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
    except OSError as e:
        raise WriteError(path, e, f"metrics of step {step} not written") from e
    for name in SCALARS:
        if name in row:
            writer.add_scalar(f"train/{name}", row[name], step)
    for name in [n for n in row if n.startswith(("jsd/", "active_tokens/")) and row[n] is not None]:
        writer.add_scalar(f"train/{name}", row[name], step)
    for name, value in (row.get("staleness") or {}).items():
        writer.add_scalar(f"train/staleness_{name}", value, step)
    bar.update(1)
    stale = {"stale": f"{row['staleness']['mean']:.1f}"} if "staleness" in row else {}
    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                    pad=f"{row['padding_fraction']:.0%}", samples=row["samples"], **stale)
