"""TP=2 worker for tests/train/teacher/test_live_teacher.py: the live teacher's top-k and tail from a vocab-split weight
equal the TP=1 reduction (a vocab of 51 padded to 52, so one rank's slice ends in a padding column), and so does the
actual-token logprob of a live cross-tokenizer teacher (train/teacher/live_xtok.py `actual_logprobs`, each logit on one rank).

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_live_tp_worker.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.train.teacher.live import teacher_topk
from pipeline.train.teacher.live_xtok import actual_logprobs


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(13, 8, generator=g, dtype=torch.float64), torch.randn(51, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(13, generator=g) > 0.2
    ref = teacher_topk(h, w, mask, 6, vocab_size=51)
    w_pad = torch.cat([w, torch.zeros(1, 8, dtype=w.dtype)])
    out = teacher_topk(h, w_pad[rank * 26:(rank + 1) * 26], mask, 6, tp_group=group, vocab_size=51, chunk_size=5)
    assert torch.equal(out[0], ref[0]), "ids"
    for a, b, name in ((out[1], ref[1], "logprobs"), (out[2], ref[2], "tail")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)  # float32 outputs of a float64 computation
    labels = torch.randint(0, 51, (13,), generator=g)  # next tokens on both ranks' slices
    act = actual_logprobs(h, w_pad[rank * 26:(rank + 1) * 26], mask, labels, out[0], out[1], tp_group=group)
    torch.testing.assert_close(act, actual_logprobs(h, w, mask, labels, ref[0], ref[1]), rtol=0, atol=1e-6,
                               msg="actual")
    print(f"TP2 OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
