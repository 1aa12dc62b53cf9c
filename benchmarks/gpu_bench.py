"""GPU train-step benchmark: a bf16 Megatron-Core step of a random Qwen2.5-0.5B-shaped student (24 layers, hidden
896, 14 heads over 2 KV heads, FFN 4864, vocab 151,936, tied embeddings), fused vs unfused output layer + GKD loss,
at 4,096 and 16,384 tokens: tokens/s, model FLOPs utilisation (MFU) and peak GPU memory.

    python -m benchmarks.gpu_bench --out gpu_bench.json          # on a CUDA machine (prints a markdown table)
    python -m benchmarks.gpu_bench --tiny                        # a 2-layer shape, CPU or GPU: checks the script
    python -m benchmarks.gpu_bench --shape Qwen2.5-1.5B          # another student shape (28 layers, hidden 1536)
    python -m benchmarks.gpu_bench --write gpu_bench.json        # here, afterwards: its section of BENCHMARKS.md

Each (tokens, variant) runs in its own process, so peak memory is its own and an out-of-memory unfused step is
recorded as such instead of ending the run. The step is the trainer's own: `setup_model_and_optimizer` (bf16
Float16Module, fp32 main weights, Adam), `forward_step`/`loss_func` and Megatron's forward-backward schedule, on
micro-batches of one row of `tokens` tokens read by the real loader from a synthetic cache (random tokens, a random
top-64 teacher: the data does not change the step's cost). No checkpoint is written.
MFU = model FLOPs per token (6 · parameters + 6 · layers · seq · hidden for causal attention: forward + backward,
as in the PaLM paper's appendix B) × tokens/s ÷ the device's dense bf16 peak (``--peak-tflops``, default by
device name: H100/H200 989, A100 312).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.store import Descriptor, TeacherCache
from pipeline.store.fingerprint import content_key, sample_id, teacher_fingerprint, tokenizer_fingerprint

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
SHAPES = {"Qwen2.5-0.5B": QWEN25_05B, "Qwen2.5-1.5B": QWEN25_15B, "tiny": TINY}
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
K = 64


def build_student(out: Path, shape: dict, device: str = "cpu") -> Path:
    """A random Qwen2-architecture folder (transformers' own config class) with a small word-level tokenizer;
    `device`: where the weights are drawn (a 1.5B student's init takes a GPU seconds, a CPU minutes)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the children measure the GPU's memory: this process keeps none of it cached
    vocab = {f"t{i}": i for i in range(256)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t0", eos_token="t1")
    tok.save_pretrained(out)
    return out


def build_cache(out: Path, student: Path, tokens: int, rows: int, vocab: int) -> Path:
    """`rows` samples of `tokens` tokens, the last 3/4 scored, with a random top-K teacher per position."""
    import numpy as np

    desc = Descriptor(teacher_fingerprint=teacher_fingerprint(student), tokenizer_fingerprint=tokenizer_fingerprint(student),
                      k=K, logprob_mode="raw_logprobs", vocab_size=vocab)
    cache = TeacherCache.create_or_open(out, desc)
    rng = np.random.default_rng(0)
    batch = []
    for i in range(rows):
        ids = rng.integers(0, vocab, tokens).astype(np.int32)
        p = tokens // 4
        n = tokens - p
        top = (rng.integers(0, vocab // K, (n, K)) + np.arange(K) * (vocab // K)).astype(np.int32)  # distinct
        lp = np.sort(np.log(rng.dirichlet(np.ones(K + 1), n)[:, :K]).astype(np.float32), axis=1)[:, ::-1]
        batch.append({"key": content_key(desc.teacher_fingerprint, ids, p, K, desc.logprob_mode),
                      "sample_id": sample_id(str(i), ids[:p], ids[p:]), "source": "student", "policy_version": 0,
                      "input_ids": ids, "first_scored": p, "topk_ids": top, "topk_logprobs": np.ascontiguousarray(lp),
                      "actual_ranks": np.full(n, K + 1, np.int32), "actual_logprobs": np.full(n, -20.0, np.float32)})
    cache.write_shard("scored-00000", batch)
    return out


def model_flops_per_token(shape: dict, seq: int) -> float:
    h, L, ffn, v = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn  # q, k, v, o and the SwiGLU MLP
    params = L * per_layer + v * h  # the (tied) output layer's matmul counts once
    return 6.0 * params + 6.0 * L * seq * h  # causal attention: half of the 12 · L · seq · h of full attention


def _child(student: str, cache: str, tokens: int, fused: bool, steps: int, bf16: bool) -> dict:
    """One variant in this process: the trainer's model/optimizer/step on micro-batches of one row of `tokens`."""
    from functools import partial

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.metrics import KD_SUM
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import forward_step

    cuda = torch.cuda.is_available()
    extra = {"attention": "sdpa"} if "attention" in TrainConfig.__dataclass_fields__ else {}
    cfg = TrainConfig(student=student, cache=[cache], micro_batch_size=1, global_batch_size=1, seq_length=tokens,
                      train_steps=steps + 1, warmup_steps=0, fused_loss=fused, bf16=bf16, progress=False, **extra)
    init_distributed(tp=1, pp=1, seed=0)
    try:
        model, ddp, optimizer, _ = setup_model_and_optimizer(cfg, Path(student))
        loader = ScoredLoader([cache], micro_batch_size=1, seq_length=tokens, seed=0)
        batches = loader.iter_from(0, prefetch=0)
        schedule = get_forward_backward_func()
        times, losses = [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 1):  # the first step warms up kernels and allocator: not timed
            mb = next(batches)
            counts = (float(mb.loss_mask.sum()), 0.0)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            (report,) = schedule(forward_step_func=partial(forward_step, counts, cfg, model.hf_vocab_size),
                                 data_iterator=iter([mb]), model=ddp, num_microbatches=1, seq_length=tokens,
                                 micro_batch_size=1)
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            losses.append(float(report[KD_SUM]) / counts[0])  # read after the clock: not part of the step
        step_s = sorted(times)[len(times) // 2]
        # losses: each step's KD loss per token (the fused and unfused variants see the same weights and rows)
        return {"step_s": step_s, "tokens_per_s": tokens / step_s, "losses": losses,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    finally:
        destroy_distributed()


def run(tokens: list[int], steps: int, tiny: bool, peak_tflops: float | None, shape_name: str | None = None,
        deadline: float | None = None, on_row=None, inprocess: bool = False) -> dict:
    """Every (tokens, variant) of one student shape, each in its own process. `deadline` (time.monotonic()): a
    child still running then is killed and its row says so, later rows are recorded as not run; `on_row(res)` is
    called after each row (gpu_check saves its JSON as it goes); `inprocess`: the rows run in this process one after
    another (no deadline, peak memory shared: only for checking the script on a tiny shape, where it saves the
    children's start-up)."""
    import torch

    shape_name = shape_name or ("tiny" if tiny else "Qwen2.5-0.5B")
    shape = SHAPES[shape_name]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    if peak_tflops is None:
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    work = Path(tempfile.mkdtemp(prefix="gkd-gpu-bench-"))
    try:
        student = build_student(work / "student", shape, "cuda" if torch.cuda.is_available() else "cpu")
        res = {"device": device, "shape": shape_name, "peak_tflops": peak_tflops,
               "steps": steps, "bf16": True, "started": _now(), "machine": _machine(device), "runs": []}
        for t in tokens:
            cache = build_cache(work / f"cache-{t}", student, t, rows=steps + 1, vocab=shape["vocab_size"])
            for fused in (True, False):
                cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--_child", str(student), str(cache), str(t),
                       str(int(fused)), str(steps)]
                row = {"tokens": t, "variant": "fused" if fused else "unfused"}
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    row["error"] = "not run: out of time"
                    res["runs"].append(row)
                    continue
                if inprocess:
                    proc = subprocess.CompletedProcess(cmd, 0, json.dumps(_child(str(student), str(cache), t, fused,
                                                                                 steps, bf16=True)), "")
                else:
                    proc = run_child(cmd, left, cwd=Path(__file__).resolve().parents[1])
                if proc.returncode is None:
                    row["error"] = f"timed out after {left:.0f} s"
                elif proc.returncode == 0:
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                    flops = model_flops_per_token(shape, t) * row["tokens_per_s"]
                    row["mfu"] = flops / (peak_tflops * 1e12) if peak_tflops else None
                else:
                    tail = proc.stderr.strip().splitlines() or ["(no output)"]
                    row["error"] = "out of memory" if "out of memory" in proc.stderr.lower() else tail[-1][-300:]
                    print("\n".join(tail[-40:]), file=sys.stderr, flush=True)  # the failed child's own account
                res["runs"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if on_row is not None:
                    on_row(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the student and caches: GiBs at the full shape
    return res


def run_child(cmd: list[str], timeout: float | None, **kw) -> subprocess.CompletedProcess:
    """`cmd` in its own process group, output captured; past `timeout` seconds the whole group is killed (its own
    children too) and the result's returncode is None."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, None, out, err)


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _machine(device: str) -> str:
    """What BENCHMARKS.md names as the machine: the device, its memory, the software, the host's cores and load."""
    import megatron.core
    import torch

    mem = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, " if torch.cuda.is_available() else ""
    return (f"{device} ({mem}torch {torch.__version__}, megatron-core {megatron.core.__version__}), host with "
            f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f}")


def markdown(res: dict) -> str:
    lines = [f"bf16 train step, random {res['shape']}-shaped student, one row per micro-batch, median of "
             f"{res['steps']} steps, on {res['device']} (MFU against {res['peak_tflops']} TFLOPS dense bf16)", "",
             "| tokens | variant | tokens/s | MFU | peak GPU memory GiB |", "|---|---|---|---|---|"]
    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| {r['tokens']:,} | {r['variant']} | {r['error']} | | |")
        else:
            mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "n/a"
            peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "n/a"
            lines.append(f"| {r['tokens']:,} | {r['variant']} | {r['tokens_per_s']:,.0f} | {mfu} | {peak} |")
    by = {(r["tokens"], r["variant"]): r for r in res["runs"] if "error" not in r}
    for t in sorted({r["tokens"] for r in res["runs"]}):
        f, u = by.get((t, "fused")), by.get((t, "unfused"))
        if f and u and f.get("peak_gib") and u.get("peak_gib"):
            lines.append(f"\nAt {t:,} tokens the fused step runs at {f['tokens_per_s'] / u['tokens_per_s']:.2f}x the "
                         f"unfused step's tokens/s in {f['peak_gib'] / u['peak_gib']:.2f}x its peak GPU memory.")
    return "\n".join(lines)


def write_section(path: Path, benchmarks: Path, command: str = "python -m benchmarks.gpu_bench --out gpu_bench.json",
                  render=None) -> None:
    """BENCHMARKS.md's `gpu` section from a run's JSON (the run happens on the GPU machine, the file is written here),
    stamped with the machine and time the JSON itself recorded; `render` makes the section's text (this module's
    `markdown` unless given: benchmarks/gpu_check.py passes its own)."""
    from benchmarks.report import Stamp, old_sections, section, write_benchmarks

    res = json.loads(path.read_text())
    stamp = Stamp(command, res["started"], res["machine"])
    sections = old_sections(benchmarks)
    sections["gpu"] = section("gpu", (render or markdown)(res), res, stamp)
    write_benchmarks(benchmarks, sections)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the script on any machine)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="the student's shape (default 0.5B)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--write", metavar="JSON", default=None,
                    help="write BENCHMARKS.md's GPU section from a run's --out file (no run)")
    ap.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write:
        write_section(Path(a.write), Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
        return 0
    if a._child:
        student, cache, t, fused, steps = a._child
        print(json.dumps(_child(student, cache, int(t), fused == "1", int(steps), bf16=True)))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    res = run([int(t) for t in a.tokens.split(",")], a.steps, a.tiny, a.peak_tflops, a.shape)
    print(markdown(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
