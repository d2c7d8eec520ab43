"""Hybrid stacks (experiments/hybrid.py): stack patterns, the models they build, the MQAR and
decode-cost tasks (smoke runs), and that a softmax layer's cache grows while a linear layer's
state does not."""
from __future__ import annotations

import json

import pytest

from linattn_lib.experiments import hybrid


def test_patterns_place_the_softmax_layers():
    assert hybrid.softmax_positions("LLLSLLLS") == (3, 7)
    assert hybrid.softmax_positions("SLLLLLLL") == (0,)
    assert all(len(p) == 8 for p in hybrid.STACKS.values())
    for bad in ("", "LLX", 3):
        with pytest.raises((ValueError, TypeError), match="softmax_positions"):
            hybrid.softmax_positions(bad)


def test_model_config_builds_the_stack():
    from linattn_lib.nn.models import TinyLM

    model = TinyLM(hybrid.model_config("LLLS", vocab_size=16, block_size=8, n_head=2, d_model=8))
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["LinearAttention"] * 3 + ["SoftmaxAttention"]
    assert model.blocks[0].attn.kind == "gated_deltanet"
    soft = TinyLM(hybrid.model_config("SS", vocab_size=16, block_size=8, n_head=2, d_model=8))
    assert all(type(b.attn).__name__ == "SoftmaxAttention" for b in soft.blocks)


def test_decode_cost_state_grows_only_with_softmax_layers():
    lin = hybrid.decode_cost("LLLL", [16, 64], d_model=16, steps=2)
    mixed = hybrid.decode_cost("LLLS", [16, 64], d_model=16, steps=2)
    assert lin[0]["state_bytes"] == lin[1]["state_bytes"]
    # one softmax layer: K and V, 64 - 16 more tokens of d_model floats each
    assert mixed[1]["state_bytes"] - mixed[0]["state_bytes"] == 2 * (64 - 16) * 16 * 4
    assert all(r["ms_per_token"] > 0 for r in lin + mixed)


@pytest.mark.parametrize("task", ["mqar", "charlm", "decode"])
def test_quick_runs(task, tmp_path):
    out = tmp_path / f"{task}.json"
    payload = hybrid.main(["--task", task, "--quick", "--out", str(out), "--no-progress"])
    assert json.loads(out.read_text())["meta"]["task"] == task
    assert [r["stack"] for r in payload["results"]] == ["all softmax", "1:7 last"]
    if task == "mqar":
        r = payload["results"][1]
        assert list(r["config"]["softmax_layers"]) == [7] and r["config"]["n_layer"] == 8
        assert r["pattern"] == "LLLLLLLS"
        assert payload["results"][0]["state_numbers"] > r["state_numbers"]
        assert set(payload["meta"]["lr_selection"]["1:7 last"]) == {"0.003", "0.01"}
    if task == "charlm":
        r = payload["results"][1]
        assert list(r["config"]["softmax_layers"]) == [7] and r["config"]["n_layer"] == 8
        assert set(payload["baselines"]["orders"]["3"]["window"]) == {str(r["config"]["ctx"])}
    assert not (tmp_path / f"{task}.json.partial").exists()


def test_charlm_config_builds_a_hybrid():
    from linattn_lib.experiments import charlm

    cfg = charlm.CharLMConfig(attention="gated_deltanet", ctx=16, n_layer=4, softmax_layers=(1, 3))
    model = charlm.make_model(cfg, vocab_size=20)
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["LinearAttention", "SoftmaxAttention"] * 2


def test_charlm_configs_follow_the_stacks():
    configs = hybrid.charlm_configs(["all softmax", "1:3"], [0, 1], dict(ctx=16, d_model=8, n_head=2))
    assert [(c.attention, tuple(c.softmax_layers), c.seed) for c in configs] == [
        ("softmax", (), 0), ("gated_deltanet", (3, 7), 0), ("softmax", (), 1), ("gated_deltanet", (3, 7), 1)]
    assert all(c.n_layer == 8 for c in configs)


@pytest.mark.parametrize("pattern", ["SSSS", "LLLS", "SLLL", "LLLL"])
def test_cache_numbers_count_the_states_the_model_returns(pattern):
    import torch

    from linattn_lib.nn.models import TinyLM

    for L in (5, 40):
        model = TinyLM(hybrid.model_config(pattern, vocab_size=8, block_size=40, n_head=2, d_model=16))
        _, states = model(torch.zeros(1, L, dtype=torch.long), return_states=True)
        n = hybrid.cache_numbers(pattern.count("S"), pattern.count("L"), L, kv_heads=2, head_dim=8, heads=2,
                                 d_k=8, d_v=8)
        assert model.state_nbytes(states) == 4 * n


def test_crossover_is_where_cache_and_states_are_equal():
    shape = dict(kv_heads=2, head_dim=256, heads=32, d_k=128, d_v=128, conv=24576)
    L = hybrid.crossover(12, 36, **shape)
    cache = hybrid.cache_numbers(12, 0, 1, **shape) * L
    assert abs(cache - hybrid.cache_numbers(0, 36, 0, **shape)) < 1e-6 * cache
    assert hybrid.crossover(0, 8, **shape) == float("inf") and hybrid.crossover(8, 0, **shape) == 0


def test_committed_mqar_and_decode_sweeps_are_complete():
    from linattn_lib.results import load_result

    stacks = list(hybrid.STACKS)
    mq = load_result("hybrid_mqar.json")
    assert [(r["stack"], r["config"]["seed"]) for r in mq["results"]] == [(s, seed) for seed in (0, 1, 2) for s in stacks]
    assert mq["meta"]["settings"] == json.loads(json.dumps(hybrid.MQAR_SETTINGS))
    for r in mq["results"]:  # each stack at the rate its first seed chose
        trials = mq["meta"]["lr_selection"][r["stack"]]
        best = max(trials, key=lambda lr: sum(trials[lr].values()))
        assert r["config"]["lr"] == float(best) == mq["meta"]["lr"][r["stack"]]
        assert list(r["config"]["softmax_layers"]) == [i for i, c in enumerate(r["pattern"]) if c == "S"] or \
            r["stack"] == "all softmax"
    dec = load_result("hybrid_decode.json")
    assert [r["stack"] for r in dec["results"]] == stacks and dec["meta"]["threads"] == 1
    for r in dec["results"]:
        n_s = r["pattern"].count("S")
        growth = r["rows"][-1]["state_bytes"] - r["rows"][0]["state_bytes"]
        d = dec["meta"]["d_model"]
        assert growth == n_s * 2 * d * 4 * (r["rows"][-1]["context"] - r["rows"][0]["context"])


def test_committed_charlm_sweep_is_complete():
    from linattn_lib.results import load_result

    stacks = list(hybrid.STACKS)
    lm = load_result("hybrid_charlm.json")
    assert [(r["stack"], r["config"]["seed"]) for r in lm["results"]] == [(s, seed) for seed in (0, 1, 2) for s in stacks]
    assert lm["meta"]["settings"] == hybrid.CHARLM_SETTINGS
    assert all(r["config"]["steps"] == hybrid.CHARLM_SETTINGS["steps"] for r in lm["results"])


@pytest.mark.parametrize("task", ["mqar", "charlm", "decode"])
def test_each_task_writes_its_own_results_file(task, monkeypatch):
    """Without --out a task writes book/results/hybrid_<task>.json, the file the book reads
    for it (the decode sweep used to overwrite hybrid_mqar.json)."""
    seen = {}

    def sweep(args, argv):
        seen["out"] = str(args.out)
        return {"results": []}

    for name in ("sweep_mqar", "sweep_charlm", "sweep_decode"):
        monkeypatch.setattr(hybrid, name, sweep)
    hybrid.main(["--task", task])
    assert seen["out"].replace("\\", "/").endswith(f"book/results/hybrid_{task}.json")
