"""A micro-batch's optional parts (train/data/batch.py: Route, Images, Spans, XtokLive): the helper that names
them, `.to` moving the tensors inside them, and the consumers that cannot use a part refusing it by name. The loader
building each part on its layouts is tested beside its mode's fixture (test_routing.py, test_xtok_train.py,
test_image_cache.py, test_live_xtok.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError
from pipeline.train.data.batch import PARTS, Behavior, Exact, Images, Route, Spans, XtokLive
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.parallel.context_parallel import columns, split


@pytest.fixture(scope="module")
def mb(tiny):
    return ScoredLoader([tiny["cache"]], micro_batch_size=2, seq_length=32, seed=0).micro_batch(0)


def _live(mb) -> XtokLive:
    n = mb.samples
    return XtokLive([], np.arange(n), np.zeros(n, np.int64), np.ones(n, np.int64), n, 32, 1, 0)


def test_parts_names_the_parts_present_and_refuse_parts_names_part_consumer_and_fix(mb):
    assert mb.parts() == () and PARTS == ("route", "images", "spans", "xtok_live", "exact", "behavior")
    mb.refuse_parts(set(), "anything")  # nothing to refuse
    full = dataclasses.replace(mb, route=Route(torch.zeros_like(mb.input_ids)), images=Images([[], []]),
                               spans=Spans(torch.full_like(mb.input_ids, -1)), xtok_live=_live(mb),
                               exact=Exact(torch.zeros(*mb.input_ids.shape, 4)),
                               behavior=Behavior(torch.zeros(mb.input_ids.shape)))
    assert full.parts() == PARTS
    full.refuse_parts(set(PARTS), "everything")
    with pytest.raises(ConfigError, match=rf"the micro-batch of {mb.keys[0]} carries spans \(cross-tokenizer span "
                                          r"heads\), which the reader cannot use; drop it$"):
        full.refuse_parts({"route", "images", "xtok_live", "exact"}, "the reader", fix={"spans": "drop it"})
    with pytest.raises(ConfigError, match=r"carries xtok_live \(a live teacher with another tokenizer\), which x "
                                          r"cannot use; change y$"):
        full.refuse_parts({"route", "images", "spans", "exact"}, "x", fix="change y")


def test_to_moves_the_tensors_inside_the_parts(mb):
    """Was: `.to` moved the micro-batch's own tensor fields only, the parts' tensors stayed behind."""
    part = dataclasses.replace(mb, route=Route(torch.zeros_like(mb.input_ids)),
                               spans=Spans(torch.full_like(mb.input_ids, -1), torch.ones(7, dtype=torch.bool), 9),
                               exact=Exact(torch.zeros(*mb.input_ids.shape, 4, dtype=torch.bfloat16), torch.ones(9, 4)),
                               behavior=Behavior(torch.zeros(mb.input_ids.shape)))
    moved = part.to("meta")
    assert moved.behavior.logprobs.is_meta and not part.behavior.logprobs.is_meta
    assert moved.exact.hidden.is_meta and moved.exact.weight.is_meta
    assert moved.to("meta").exact.weight is part.to("meta").exact.weight  # the output layer moves once per device
    assert moved.input_ids.is_meta and moved.route.teacher.is_meta and moved.spans.head.is_meta
    assert moved.spans.matched.is_meta and moved.spans.teacher_vocab == 9
    assert not part.route.teacher.is_meta and not part.spans.head.is_meta  # the original is unchanged
    assert moved.keys == part.keys and moved.tokens == part.tokens


def test_context_parallel_splits_the_route_part_like_the_rows(mb):
    """cp=3 on 32-column rows (padded to 36): the route part is cut into the same zig-zag chunks as the loss mask,
    its padded columns -1 (no teacher)."""
    route = torch.where(mb.loss_mask, torch.arange(mb.input_ids.shape[0])[:, None], -1)
    routed = dataclasses.replace(mb, route=Route(route))
    b, w = route.shape
    whole = torch.full((b, 36), -7, dtype=torch.long)
    for r in range(3):
        local, _ = split(routed, 3, r)
        assert local.parts() == ("route",) and local.route.teacher.shape == (b, 12)
        assert torch.equal(local.route.teacher >= 0, local.loss_mask)
        whole[:, columns(36, 3, r)] = local.route.teacher
    assert torch.equal(whole[:, :w], route) and bool((whole[:, w:] == -1).all())


def test_context_parallel_splits_the_exact_teachers_states_with_their_positions(mb):
    """A hidden-state cache's part: each CP rank keeps its positions' teacher states (padding 0, under no loss) and
    the one output layer; put back together, the ranks' states are the micro-batch's."""
    b, w = mb.input_ids.shape
    states = torch.arange(b * w * 3, dtype=torch.float32).reshape(b, w, 3) + 1
    weight = torch.randn(5, 3)
    exact = dataclasses.replace(mb, exact=Exact(states, weight))
    width = -(-w // 6) * 6
    whole = torch.full((b, width, 3), -1.0)
    for r in range(3):
        local, _ = split(exact, 3, r)
        assert local.parts() == ("exact",) and local.exact.weight is weight
        assert local.exact.hidden.shape == (b, width // 3, 3)
        whole[:, columns(width, 3, r)] = local.exact.hidden
    assert torch.equal(whole[:, :w], states) and bool((whole[:, w:] == 0).all())


def test_context_parallel_splits_the_samplers_logprobs_with_their_positions(mb):
    """loss=opd's importance weights' input: each CP rank keeps its positions' logprobs (padding NaN: no weight)."""
    b, w = mb.input_ids.shape
    logprobs = torch.where(mb.loss_mask, -torch.arange(b * w, dtype=torch.float32).reshape(b, w) - 1, math.nan)
    sampled = dataclasses.replace(mb, behavior=Behavior(logprobs))
    width = -(-w // 6) * 6
    whole = torch.zeros((b, width))
    for r in range(3):
        local, _ = split(sampled, 3, r)
        assert local.parts() == ("behavior",)
        assert torch.equal(local.behavior.logprobs.isfinite(), local.loss_mask)
        whole[:, columns(width, 3, r)] = local.behavior.logprobs
    assert torch.allclose(whole[:, :w], logprobs, rtol=0, atol=0, equal_nan=True)
    assert bool(whole[:, w:].isnan().all())


@pytest.mark.parametrize("part", ["images", "spans", "xtok_live"])
def test_context_parallel_refuses_the_parts_it_cannot_split_by_name(mb, part):
    """Was: split passed images and a live cross-tokenizer teacher's layout on whole (the rows cut, their parts not)
    and failed on spans with a KeyError or an IndexError."""
    value = {"images": Images([[("root", "h")], []]), "spans": Spans(torch.full_like(mb.input_ids, -1)),
             "xtok_live": _live(mb)}[part]
    with pytest.raises(ConfigError, match=rf"carries {part} .*which context parallelism \(context_parallel_size=2\) "
                                          r"cannot use; .*context_parallel_size=1"):
        split(dataclasses.replace(mb, **{part: value}), 2, 0)


def test_the_loss_refuses_spans_unless_the_loss_is_cross_tokenizer(mb):
    from pipeline.train.config import TrainConfig
    from pipeline.train.step import loss_func

    spans = dataclasses.replace(mb, spans=Spans(torch.full_like(mb.input_ids, -1)))
    for loss in ("gkd", "opd"):
        with pytest.raises(ConfigError, match=rf"carries spans .*which loss={loss} cannot use; cross-tokenizer rows "
                                              r"train with loss=gold \(or loss=uld\)"):
            loss_func(spans, (1.0, 1.0), TrainConfig(cache=[], loss=loss), 10, None, torch.zeros(0))
