"""Fixtures for the on-policy driver tests: a tiny teacher and a tiny *tied* student (the case where an in-place
vLLM weight reload goes stale on CPU) sharing one tokenizer, and engines shared by the whole module."""

from __future__ import annotations

import pytest
from onpolicy_helpers import build_models


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_models(tmp_path_factory.mktemp("onpolicy-models"))


@pytest.fixture(scope="module")
def engines():
    from pipeline.onpolicy.engines import Engines

    e = Engines()
    yield e
    e.close()
