"""The same estimate asked again (`estimate._FAST`, `_replayed_ranks`) gives what a first call
gives, in objects of its own; arguments that differ in type or sign, and a model name that
becomes a file, are not read back."""

from __future__ import annotations

import importlib
import json

import pytest

import pipemem
from pipemem.errors import UserError

E = importlib.import_module("pipemem.estimate")
PLAN = dict(tp=2, pp=4, vpp=2, microbatches=8, seq_len=1024, gpu="rtx3090", dist_opt=True, dp=2)


def _numbers(e) -> dict:
    d = e.to_dict()
    d.pop("inputs", None)
    return d


def test_again_gives_the_same_numbers_in_fresh_objects():
    E._FAST.clear()
    a = pipemem.estimate("llama3.2-1b", **PLAN)
    b = pipemem.estimate("llama3.2-1b", **PLAN)  # read back
    E._FAST.clear()
    E._REPLAYED.clear()
    c = pipemem.estimate("llama3.2-1b", **PLAN)  # from the plan's caches only
    assert json.dumps(_numbers(a), sort_keys=True) == json.dumps(_numbers(b), sort_keys=True)
    assert json.dumps(_numbers(b), sort_keys=True) == json.dumps(_numbers(c), sort_keys=True)
    assert a.plan is not b.plan and a.warnings is not b.warnings
    assert all(x is not y for x, y in zip(a.ranks, b.ranks))
    a.plan.tp = 99
    a.warnings.append("changed")
    assert pipemem.estimate("llama3.2-1b", **PLAN).plan.tp == 2
    assert "changed" not in pipemem.estimate("llama3.2-1b", **PLAN).warnings


def test_arguments_of_another_type_are_checked_again():
    pipemem.estimate("llama3.2-1b", **PLAN)
    with pytest.raises(UserError, match="--tp"):
        pipemem.estimate("llama3.2-1b", **dict(PLAN, tp=2.0))
    with pytest.raises(UserError, match="--dist-opt"):
        pipemem.estimate("llama3.2-1b", **dict(PLAN, dist_opt=1))
    assert E._fast_key("m", {"gpu_memory": 0.0}) != E._fast_key("m", {"gpu_memory": -0.0})
    assert E._fast_key("m", {"pp_layout": (1, 2.0)}) is None


def test_a_model_name_that_becomes_a_file_is_read_from_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = pipemem.estimate("llama3.2-1b", **PLAN)
    from pipemem.presets import load_model_config

    cfg = load_model_config("llama3.2-1b")[1]
    cfg["num_hidden_layers"] = 8
    (tmp_path / "llama3.2-1b").write_text(json.dumps(cfg))
    second = pipemem.estimate("llama3.2-1b", **PLAN)
    assert second.arch.layers == 8 != first.arch.layers
