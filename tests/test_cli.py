import subprocess
import sys

import numpy as np
from scored_rows import make_descriptor, make_row

from pipeline.cli import main
from pipeline.store import TeacherCache


def test_cache_stats_and_verify(tmp_path, capsys):
    d = make_descriptor()
    cache = TeacherCache.create_or_open(tmp_path / "c", d)
    rng = np.random.default_rng(0)
    cache.write_shard("s-00000-of-00001", [make_row(rng, d, 20, 5) for _ in range(3)])
    assert main(["cache", "stats", str(cache.root)]) == 0
    out = capsys.readouterr().out
    assert "bytes_per_scored_token" in out and "samples" in out and d.teacher_fingerprint in out
    assert main(["cache", "verify", str(cache.root)]) == 0
    path = cache.shard_paths()[0]
    path.write_bytes(path.read_bytes()[:-10])
    assert main(["cache", "verify", str(cache.root)]) == 1
    assert str(path) in capsys.readouterr().err


def test_cache_on_a_non_cache_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["cache", "stats", str(tmp_path)]) == 2
    assert "not a teacher cache" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and "cache" in out.stdout


def test_fingerprint_command_warms_the_record(tmp_path, capsys):
    import json
    import os
    import time

    from pipeline.store.fingerprint import teacher_fingerprint

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(10_000))
    old = time.time() - 100
    for p in model.iterdir():
        os.utime(p, (old, old))
    assert main(["fingerprint", str(model), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["fingerprint", str(model), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["hashed"] == ["model.safetensors"] and second["hashed"] == []
    assert first["fingerprint"] == second["fingerprint"] == teacher_fingerprint(model, rehash=True)
    assert main(["fingerprint", str(model)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == first["fingerprint"] and "1 from the record" in out.err
