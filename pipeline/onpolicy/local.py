"""On-policy GKD, local executor: every stage of every cycle in this process, engines kept open across cycles.

The stages are those of stages.py, called in order from the stage state.json names; after each one
`record_stage` writes state.json, so a killed run restarts at the first stage not recorded as done.
"""

from __future__ import annotations

import sys
import time

from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.stages import (
    Workspace,
    cycle_info,
    cycle_stages,
    eval_stage,
    export_stage,
    generate_stage,
    read_metrics,
    record_stage,
    score_stage,
    setup_stage,
    train_stage,
)
from pipeline.onpolicy.state import State


def run_stage(ws: Workspace, engines: Engines, state: State, stage: str, cycle: int, info: dict) -> None:
    """One stage of one cycle in this process; what it reports goes into the cycle's `info`."""
    if stage == "export":
        info.update(export_stage(ws, cycle))
    elif stage == "generate":
        info.update(generate_stage(ws, engines, cycle))
    elif stage == "score":
        info.update(score_stage(ws, cycle, engines.scorer(ws.cfg, ws.teacher))[0])
    elif stage == "train":
        train_stage(ws, state, cycle, info)
    elif stage == "eval":
        info.update(eval_stage(ws, cycle))
    else:
        raise ValueError(f"unknown stage {stage!r}")


def run_local(cfg: OnPolicyConfig, engines: Engines) -> list[dict]:
    """Run (or resume) the on-policy loop in this process on `engines`; returns the metrics lines."""
    from tqdm import tqdm

    ws = Workspace.open(cfg)
    state = State.load(ws.out)
    setup_stage(ws, engines, state, lambda: state.save(ws.out))
    bar = tqdm(total=cfg.num_cycles, initial=min(state.cycle, cfg.num_cycles), desc="onpolicy", unit="cycle",
               disable=not cfg.progress, file=sys.stderr)
    try:
        while state.cycle < cfg.num_cycles:
            c = state.cycle
            info = cycle_info(cfg, state, c)
            for stage in STAGES[STAGES.index(state.stage):]:
                t0 = time.perf_counter()
                if stage in cycle_stages(info["on_policy"]):
                    run_stage(ws, engines, state, stage, c, info)
                info["seconds"][stage] = round(info["seconds"].get(stage, 0.0) + time.perf_counter() - t0, 2)
                record_stage(cfg, state, c, stage, info)
            bar.update(1)
            bar.set_postfix(loss=f"{info['loss']:.4f}", kl=f"{info.get('heldout_kl', float('nan')):.4f}",
                            mode="on" if info["on_policy"] else "off")
    finally:
        bar.close()
    return read_metrics(ws.out)
