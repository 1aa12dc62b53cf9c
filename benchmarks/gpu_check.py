"""The one prepared device check (issue 49): everything this project measures on a GPU, in one command of <= 8 minutes
on one H100/H200, written into one JSON as it goes (a part that fails or runs out of time records why; the others
still run).

On the device machine, from the repository root, with build/gpu-wheels carried (made here by scripts/gpu_wheels.sh:
megatron-core, fla-core, transformers 5.19, zstandard; the machine has Python 3.12, CUDA torch, triton, peft and the
rest). The single command (device tool: carry ["build/gpu-wheels"], timeout_s 600):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site build/gpu-wheels/*.whl && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout 560 python3 -m benchmarks.gpu_check --out $OUT/gpu_check.json

Here, afterwards (the JSON comes back under the tool's files_at):

    python -m benchmarks.gpu_check --write PATH/gpu_check.json     # BENCHMARKS.md's GPU section
    python -m benchmarks.gpu_check --tiny --out x.json             # tiny shapes, CPU: checks the script (CI's test)

Parts, in this order, each with its own time limit inside `--budget` seconds (default 480):
- cuda_tests: `pytest tests/train/models/test_attention.py tests/train/models/test_model.py tests/train/models/test_precision.py` on the
  device (they follow the model's device, d726355); counts and the failures' tail. Tiny mode only collects them.
- fused_0.5b, fused_1.5b: benchmarks/gpu_bench.py's bf16 Megatron-Core train step of a random Qwen2.5-0.5B- and
  Qwen2.5-1.5B-shaped student, fused vs unfused output layer + GKD loss at 16,384 then 4,096 tokens (one row per
  micro-batch, median of `--steps` steps after one untimed): tokens/s, MFU, peak GPU memory, each variant in its
  own process.
- qwen35: the hf backend's train step (step.train_step: bf16 autocast body, fp32 fused output layer + loss,
  AdamW) of a random Qwen3.5-4B-widths text student cut to 4 layers (3 Gated DeltaNet + 1 gated full attention;
  hidden 2560, FFN 9216, 16 query / 4 KV heads of 256, DeltaNet 16 key / 32 value heads of 128, conv 4, vocab
  248,320, tied embeddings), one padded row of 4,096 tokens: once with flash-linear-attention's Triton kernels
  (`fla`, which transformers picks at import) and once with `fla` hidden (transformers' PyTorch fallback), each in
  its own process; tokens/s, peak memory, the first step's loss (same weights and row: the two must agree), which
  kernel ran, and with FLA a packing probe: two documents in one row with `cu_seq_lens_q` against each alone
  (docs/dependencies.md says why the causal conv still leaks across the boundary).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import gpu_bench

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ("tests/train/models/test_attention.py", "tests/train/models/test_model.py", "tests/train/models/test_precision.py")
# part -> its time limit in seconds (the parts together fit the default --budget)
LIMITS = {"cuda_tests": 120, "fused_0.5b": 100, "fused_1.5b": 120, "qwen35": 140}
QWEN35_4B_WIDTHS = dict(vocab_size=248_320, hidden_size=2560, intermediate_size=9216, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                        max_position_embeddings=32768, tie_word_embeddings=True)
QWEN35_TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                   max_position_embeddings=4096, tie_word_embeddings=True)
QWEN35_LAYERS = 4
ROW_TITLES = ("| gpu fused vs unfused tokens/s at 16k |", "| gpu mfu at 16k, 1.5B-shaped student |",
              "| gpu qwen3.5 hf step tokens/s, fla vs torch |", "| gpu cuda tests |")


# ---------------------------------------------------------------- the machine


def versions() -> dict:
    """The software the check ran with (None where a package is missing)."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "megatron-core", "fla-core", "flash-linear-attention", "peft",
                 "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    import torch

    out["cuda"] = torch.version.cuda
    return out


def device_info() -> dict:
    import torch

    info = {"name": "CPU", "memory_gib": None, "driver": None, "cores": os.cpu_count(),
            "load_average_at_start": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        info["name"] = torch.cuda.get_device_name()
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            info["driver"] = q.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ---------------------------------------------------------------- parts


def part_cuda_tests(deadline: float, tiny: bool, **_) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS]
    if tiny:
        cmd.append("--collect-only")
    t0 = time.monotonic()
    proc = gpu_bench.run_child(cmd, max(1.0, deadline - time.monotonic()), cwd=ROOT, env=_child_env())
    out = {"command": " ".join(["pytest", *cmd[3:]]), "wall_s": round(time.monotonic() - t0, 1),
           "returncode": proc.returncode}
    text = (proc.stdout or "") + (proc.stderr or "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|tests? collected)",
                                               text)}
    out["counts"] = {k.rstrip("s").replace("tests collected", "collected").replace("test collected", "collected"): v
                     for k, v in counts.items()}
    if proc.returncode is None:
        out["error"] = f"timed out after {out['wall_s']:.0f} s"
    elif proc.returncode != 0:
        out["error"] = f"pytest exited {proc.returncode}"
    if "error" in out:
        out["tail"] = text.strip().splitlines()[-40:]
    return out


def part_fused(shape_name: str, tokens: list[int], steps: int, deadline: float, save, tiny: bool = False) -> dict:
    holder: dict = {}

    def on_row(res: dict) -> None:
        holder.update(res)
        save(holder)

    return gpu_bench.run(tokens, steps, tiny=False, peak_tflops=None, shape_name=shape_name, deadline=deadline,
                         on_row=on_row, inprocess=tiny)


def build_qwen35(out: Path, widths: dict, layers: int) -> Path:
    """A random Qwen3.5 text student (transformers' Qwen3_5TextConfig, its default 3:1 DeltaNet to full-attention
    layout), drawn on the GPU where there is one, saved in bf16."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(num_hidden_layers=layers, **widths)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def part_qwen35(tiny: bool, steps: int, deadline: float, save) -> dict:
    widths = QWEN35_TINY if tiny else QWEN35_4B_WIDTHS
    seq = 64 if tiny else 4096
    res = {"widths": widths, "layers": QWEN35_LAYERS, "seq_length": seq, "steps": steps, "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="gkd-gpu-check-"))
    try:
        student = build_qwen35(work / "qwen35", widths, QWEN35_LAYERS)
        for impl in ("fla", "torch"):
            left = deadline - time.monotonic()
            if left <= 0:
                res["runs"][impl] = {"error": "not run: out of time"}
                continue
            if impl == "fla" and importlib.util.find_spec("fla") is None:  # no process started to find that out
                res["runs"][impl] = {"error": "flash-linear-attention not in use (fla is not installed)"}
                continue
            cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--_qwen35", str(student), impl, str(steps),
                   str(seq)]
            proc = gpu_bench.run_child(cmd, left, cwd=ROOT, env=_child_env())
            if proc.returncode == 0:
                res["runs"][impl] = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                tail = (proc.stderr or "").strip().splitlines() or ["(no output)"]
                print("\n".join(tail[-40:]), file=sys.stderr, flush=True)
                res["runs"][impl] = {"error": f"timed out after {left:.0f} s" if proc.returncode is None else
                                     ("out of memory" if "out of memory" in proc.stderr.lower() else tail[-1][-300:])}
            print(json.dumps({impl: res["runs"][impl]}), file=sys.stderr, flush=True)
            save(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def _kernel_in_use() -> str:
    """Which function transformers' Qwen3.5 DeltaNet layers call for the chunked gated delta rule."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    fn = inspect.getclosurevars(m.torch_chunk_gated_delta_rule).nonlocals.get("implementation")
    return f"{fn.__module__}.{fn.__name__}" if fn is not None else "unknown"


def qwen35_child(student: str, impl: str, steps: int, seq: int) -> dict:
    """One Qwen3.5 variant in this process: `torch` hides `fla` before transformers looks for it."""
    if impl == "torch":
        sys.modules["fla"] = None  # import fla -> ImportError: transformers keeps its PyTorch fallback
    import torch

    from benchmarks.hf_bench import _step, _trainer
    from benchmarks.step_bench import random_batch
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    cuda = torch.cuda.is_available()
    kernel = _kernel_in_use()
    out = {"kernel": kernel}
    if impl == "fla" and not kernel.startswith("fla."):
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
            why = "transformers did not pick it"
        except Exception as e:  # noqa: BLE001 - the reason is what is recorded
            why = f"{type(e).__name__}: {e}"
        out["error"] = f"flash-linear-attention not in use ({why})"
        return out
    init_distributed(tp=1, pp=1, seed=0)
    try:
        tr = _trainer(student, "hf", seq_length=seq, **({"bf16": True} if cuda else {}))
        vocab = tr["model"].hf_vocab_size
        batches = [random_batch(vocab, 1, seq, s) for s in range(steps + 1)]
        # the loss of the first row on the initial weights (drawn the same for both variants): they must agree
        out["first_loss"] = _first_loss(tr, batches[0], vocab)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i, mb in enumerate(batches):  # the first step (kernels' autotuning, allocator) is not timed
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(tr, [mb])
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]
        out.update(step_s=step_s, tokens_per_s=seq / step_s, step_times=times,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   parameters=sum(p.numel() for p in tr["model"].parameters()))
        if impl == "fla" and cuda:
            try:
                out["packing_probe"] = _packing_probe(tr["model"].base(), vocab)
            except Exception as e:  # noqa: BLE001 - recorded, the timing above stands
                out["packing_probe"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        destroy_distributed()
    return out


def _first_loss(tr: dict, mb, vocab: int) -> float:
    """The loss of `mb` under the student's current weights, forward only."""
    import torch

    from pipeline.train.step import forward_step

    counts = (float(mb.loss_mask.sum()), 0.0)
    with torch.no_grad():
        out, loss_of = forward_step(counts, tr["cfg"], vocab, iter([mb]), tr["ddp"])
        loss, _, _ = loss_of(out)
    return float(loss)


def _packing_probe(lm, vocab: int) -> dict:
    """Two documents packed in one row (positions restarting, `cu_seq_lens_q` for FLA's varlen kernels) against each
    alone, bf16 autocast, eval mode: the largest logit gap over each document, relative to the logits' scale; the
    same without `cu_seq_lens_q` (the DeltaNet state then runs on across the boundary)."""
    import torch

    dev = next(lm.parameters()).device
    g = torch.Generator().manual_seed(0)
    lens = (300, 500)
    docs = [torch.randint(0, vocab, (1, n), generator=g).to(dev) for n in lens]
    row = torch.cat(docs, 1)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(dev)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=dev)
    was = lm.training
    lm.eval()
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            alone = torch.cat([lm(input_ids=d, use_cache=False).logits[0].float() for d in docs])
            packed = lm(input_ids=row, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=max(lens), max_length_k=max(lens)).logits[0].float()
            plain = lm(input_ids=row, position_ids=pos, use_cache=False).logits[0].float()
    finally:
        lm.train(was)
    scale = float(alone.abs().max())
    a = lens[0]

    def gap(x, sl):
        return float((x[sl] - alone[sl]).abs().max()) / scale

    return {"lengths": list(lens), "gap_doc1_cu_seqlens": gap(packed, slice(0, a)),
            "gap_doc2_cu_seqlens": gap(packed, slice(a, None)),
            "gap_doc2_cu_seqlens_first3": gap(packed, slice(a, a + 3)),
            "gap_doc2_cu_seqlens_after50": gap(packed, slice(a + 50, None)),
            "gap_doc2_no_cu_seqlens": gap(plain, slice(a, None))}


# ---------------------------------------------------------------- the run


def run(out_path: Path, budget: float, tiny: bool, steps: int) -> dict:
    import torch  # noqa: F401 - fail here, not in a part, where torch itself is missing

    start = time.monotonic()
    dev = device_info()
    res = {"started": gpu_bench._now(), "tiny": tiny, "budget_s": budget, "device": dev, "versions": versions(),
           "parts": {}}
    res["machine"] = _machine_line(dev, res["versions"])

    def save(_=None) -> None:
        out_path.write_text(json.dumps(res, indent=1, default=str))

    tokens = [64] if tiny else [16384, 4096]
    parts = {
        "cuda_tests": lambda d: part_cuda_tests(d, tiny),
        "fused_0.5b": lambda d: part_fused("tiny" if tiny else "Qwen2.5-0.5B", tokens, steps, d,
                                           lambda r: _set_part(res, "fused_0.5b", r, save), tiny),
        "fused_1.5b": lambda d: part_fused("tiny" if tiny else "Qwen2.5-1.5B", tokens, steps, d,
                                           lambda r: _set_part(res, "fused_1.5b", r, save), tiny),
        "qwen35": lambda d: part_qwen35(tiny, steps, d, lambda r: _set_part(res, "qwen35", r, save)),
    }
    for name, fn in parts.items():
        t0 = time.monotonic()
        deadline = min(t0 + LIMITS[name], start + budget)
        if deadline <= t0:
            res["parts"][name] = {"error": "not run: out of time"}
            save()
            continue
        print(f"gpu_check: {name} (up to {deadline - t0:.0f} s)", file=sys.stderr, flush=True)
        try:
            part = fn(deadline)
        except Exception as e:  # noqa: BLE001 - a failed part is recorded, the next one still runs
            import traceback

            traceback.print_exc()
            part = {**res["parts"].get(name, {}), "error": f"{type(e).__name__}: {str(e)[:300]}"}
        part["wall_s"] = round(time.monotonic() - t0, 1)
        res["parts"][name] = part
        save()
    res["wall_s"] = round(time.monotonic() - start, 1)
    save()
    return res


def _set_part(res: dict, name: str, part: dict, save) -> None:
    res["parts"][name] = dict(part)
    save()


def _machine_line(dev: dict, v: dict) -> str:
    mem = f"{dev['memory_gib']:.0f} GiB, driver {dev['driver']}; " if dev.get("memory_gib") else ""
    soft = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers", "megatron-core", "fla-core", "peft")
                     if v.get(k))
    return (f"{dev['name']} ({mem}{soft}; CUDA {v.get('cuda')}, Python {v['python']}), host with {dev['cores']} "
            f"cores, load average at start {dev['load_average_at_start']:.1f}")


# ---------------------------------------------------------------- BENCHMARKS.md


def _runs(res: dict, part: str) -> dict:
    p = res["parts"].get(part) or {}
    return {(r["tokens"], r["variant"]): r for r in p.get("runs", []) if "error" not in r}


def _why(res: dict, part: str, *keys) -> str:
    """Why a row has no number: the part's or the run's recorded error."""
    p = res["parts"].get(part) or {}
    if "error" in p:
        return f"not measured: {p['error']}"
    for r in p.get("runs", []) if isinstance(p.get("runs"), list) else []:
        if (r.get("tokens"), r.get("variant")) in keys and "error" in r:
            return f"not measured: {r['tokens']:,} {r['variant']}: {r['error']}"
    return "not measured"


def rows(res: dict) -> list[str]:
    """The section's table of headline rows (first cells: ROW_TITLES)."""
    out = ["| measure | value | goal |", "|---|---|---|"]
    by = _runs(res, "fused_0.5b")
    f, u = by.get((16384, "fused")), by.get((16384, "unfused"))
    if f and u and f.get("peak_gib") and u.get("peak_gib"):
        f4, u4 = by.get((4096, "fused")), by.get((4096, "unfused"))
        at4 = (f"; at 4k {f4['tokens_per_s'] / u4['tokens_per_s']:.2f}× in {f4['peak_gib'] / u4['peak_gib']:.2f}× "
               "the memory") if f4 and u4 and f4.get("peak_gib") and u4.get("peak_gib") else ""
        val = (f"{f['tokens_per_s'] / u['tokens_per_s']:.2f}× ({f['tokens_per_s']:,.0f} vs {u['tokens_per_s']:,.0f} "
               f"tokens/s) in {f['peak_gib'] / u['peak_gib']:.2f}× the peak GPU memory ({f['peak_gib']:.1f} vs "
               f"{u['peak_gib']:.1f} GiB); Qwen2.5-0.5B-shaped Megatron student, bf16, one row of 16,384 tokens"
               f"{at4}")
    else:
        val = _why(res, "fused_0.5b", (16384, "fused"), (16384, "unfused"))
    out.append(f"{ROW_TITLES[0]} {val} | ≥ 0.98× at ≤ 0.70× peak memory |")
    by = _runs(res, "fused_1.5b")
    f, u = by.get((16384, "fused")), by.get((16384, "unfused"))
    if f and f.get("mfu") is not None:
        un = (f"; unfused {100 * u['mfu']:.1f} % ({u['tokens_per_s']:,.0f} tokens/s, {u['peak_gib']:.1f} GiB)"
              if u and u.get("mfu") is not None else f"; unfused {_why(res, 'fused_1.5b', (16384, 'unfused'))}")
        peak = (res["parts"]["fused_1.5b"] or {}).get("peak_tflops")
        val = (f"{100 * f['mfu']:.1f} % fused ({f['tokens_per_s']:,.0f} tokens/s, {f['peak_gib']:.1f} GiB peak){un}; "
               f"Qwen2.5-1.5B-shaped Megatron student, bf16, one row of 16,384 tokens, against {peak} TFLOPS")
    else:
        val = _why(res, "fused_1.5b", (16384, "fused"))
    out.append(f"{ROW_TITLES[1]} {val} | ≥ 35 % |")
    q = res["parts"].get("qwen35") or {}
    fl, tc = (q.get("runs") or {}).get("fla") or {}, (q.get("runs") or {}).get("torch") or {}
    if "tokens_per_s" in fl and "tokens_per_s" in tc:
        val = (f"{fl['tokens_per_s']:,.0f} vs {tc['tokens_per_s']:,.0f} tokens/s "
               f"({fl['tokens_per_s'] / tc['tokens_per_s']:.1f}×; peak {fl['peak_gib']:.1f} vs {tc['peak_gib']:.1f} "
               f"GiB; first loss {fl['first_loss']:.4f} vs {tc['first_loss']:.4f})")
    else:
        parts = [f"{k}: {r['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in r else f"{k}: {r.get('error', q.get('error', 'not measured'))}"
                 for k, r in (("fla", fl), ("torch", tc))]
        val = "; ".join(parts)
    if "widths" in q:
        w = q["widths"]
        prec = "bf16" if res["device"].get("memory_gib") else "fp32 on CPU"
        name = "tiny" if res["tiny"] else "Qwen3.5-4B"
        val += (f"; hf backend, {prec}, {name} widths cut to {q['layers']} layers (hidden {w['hidden_size']}, "
                f"vocab {w['vocab_size']:,}), one padded row of {q['seq_length']:,} tokens")
    out.append(f"{ROW_TITLES[2]} {val} | (report) |")
    t = res["parts"].get("cuda_tests") or {}
    c = t.get("counts", {})
    val = ", ".join(f"{n} {k}" for k, n in c.items()) or "no counts"
    if "error" in t:
        val += f" ({t['error']})"
    out.append(f"{ROW_TITLES[3]} {val}; {' '.join(CUDA_TESTS)} | all pass |")
    return out


def markdown(res: dict) -> str:
    v = res["versions"]
    lines = [f"One run of `benchmarks/gpu_check.py` on {res['device']['name']}: "
             f"{', '.join(f'{k} {x}' for k, x in v.items() if x)}; load average at start "
             f"{res['device']['load_average_at_start']}; {res.get('wall_s', '?')} s in all (budget {res['budget_s']} s).",
             "", *rows(res)]
    for part in ("fused_0.5b", "fused_1.5b"):
        p = res["parts"].get(part) or {}
        if p.get("runs"):
            lines += ["", gpu_bench.markdown(p)]
    q = (res["parts"].get("qwen35") or {}).get("runs", {}).get("fla", {}).get("packing_probe")
    if q:
        lines += ["", f"Qwen3.5 packing probe with FLA (two documents in one row against each alone, bf16): "
                  f"{json.dumps(q)}"]
    return "\n".join(lines)


def write_section(path: Path, benchmarks: Path) -> None:
    """BENCHMARKS.md's `gpu` section from a check's JSON (gpu_bench.write_section with this module's text)."""
    gpu_bench.write_section(path, benchmarks, "python -m benchmarks.gpu_check --out gpu_check.json", markdown)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="the JSON, written as each part ends")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all parts together")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one untimed)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, tests only collected: checks the script")
    ap.add_argument("--write", metavar="JSON", default=None, help="write BENCHMARKS.md's GPU section (no run)")
    ap.add_argument("--benchmarks", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)
    ap.add_argument("--_qwen35", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write:
        write_section(Path(a.write), Path(a.benchmarks))
        return 0
    if a._qwen35:
        student, impl, steps, seq = a._qwen35
        print(json.dumps(qwen35_child(student, impl, int(steps), int(seq))))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    res = run(Path(a.out), a.budget, a.tiny, a.steps)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
