"""MQAR: the data format, the token shift, the CLI's JSON, and that a tiny model learns."""
import json

import pytest
import torch

from linattn_lib.experiments import mqar
from linattn_lib.experiments.mqar import (
    IGNORE,
    MQARConfig,
    build_model,
    evaluate,
    make_mixed_batch,
    make_mqar_batch,
    num_queries,
    recall_accuracy,
    run,
    state_numbers,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Training runs on one thread (the sweep's setting, and reproducible); the process's
    thread count is restored afterwards (the CLI's in-process jobs set it too)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class LookupOracle(torch.nn.Module):
    """A "model" that reads the key-value table from the context and, at a queried key, puts
    its logit on that key's value; `wrong_keys` are answered with `wrong_value` (a key token,
    never a value) instead, so the accuracy that is left is known in advance."""

    def __init__(self, vocab_size, wrong_keys=(), wrong_value=0):
        super().__init__()
        self.V, self.wrong_keys, self.wrong_value = vocab_size, set(wrong_keys), wrong_value

    def forward(self, x):
        B, T = x.shape
        logits = torch.zeros(B, T, self.V)
        for b in range(B):
            table = {}
            for t in range(0, T, 2):  # (key, value) pairs: the context, then the queries
                key = x[b, t].item()
                if key in table:  # a key seen before: a query, answered from the table
                    logits[b, t, self.wrong_value if key in self.wrong_keys else table[key]] = 1.0
                elif t + 1 < T:
                    table[key] = x[b, t + 1].item()
        return logits


def expected_oracle_accuracy(cfg, n, wrong_keys):
    """The fraction of queries whose key is not in wrong_keys, counted on evaluate's batches."""
    gen = torch.Generator().manual_seed(10_000 + 100 * cfg.seed + n)
    right = total = 0
    for _ in range(cfg.eval_batches):
        x, y = make_mqar_batch(cfg.eval_batch_size, n, cfg.seq_len, cfg.vocab_size, generator=gen)
        asked = x[y != IGNORE]
        right += sum(1 for key in asked.tolist() if key not in wrong_keys)
        total += asked.numel()
    return right / total


def test_evaluate_scores_known_answers():
    """evaluate / recall_accuracy against models whose accuracy is known: a perfect lookup scores
    1, one that answers every query with a fixed token 0, one that gets half the keys wrong the
    fraction of queries asking for the other half."""
    cfg = MQARConfig(eval_pairs=(2, 4), seq_len=16, vocab_size=16, eval_batches=2, eval_batch_size=32)
    assert evaluate(LookupOracle(16), cfg) == {2: 1.0, 4: 1.0}
    assert evaluate(LookupOracle(16, wrong_keys=range(8)), cfg) == {2: 0.0, 4: 0.0}
    got = evaluate(LookupOracle(16, wrong_keys=range(0, 8, 2)), cfg)
    for n in (2, 4):
        want = expected_oracle_accuracy(cfg, n, set(range(0, 8, 2)))
        assert 0.2 < want < 0.8 and got[n] == pytest.approx(want, abs=1e-6), (n, got, want)
    x, y = make_mqar_batch(8, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    assert recall_accuracy(LookupOracle(16), x, y) == 1.0


def test_batch_format_targets_only_after_queried_keys():
    g = torch.Generator().manual_seed(0)
    B, n, T, V = 16, 5, 32, 20
    x, y = make_mqar_batch(B, n, T, V, generator=g)
    assert x.shape == y.shape == (B, T - 1)
    half = V // 2
    for b in range(B):
        seq = torch.cat([x[b], y[b, -1:].clamp(min=0)])
        keys, vals = seq[0:2 * n:2], seq[1:2 * n:2]
        assert len(set(keys.tolist())) == n and (keys < half).all()  # distinct keys from the lower half
        assert ((vals >= half) & (vals < V)).all()
        table = dict(zip(keys.tolist(), vals.tolist()))
        answered = (y[b] != IGNORE).nonzero().flatten()
        assert len(answered) == num_queries(n, T)
        for t in answered.tolist():
            assert t >= 2 * n and (t - 2 * n) % 2 == 0  # only at queried keys, after the context
            assert y[b, t].item() == table[x[b, t].item()]  # the target is that key's value
        assert (y[b, : 2 * n] == IGNORE).all()


def test_batch_is_reproducible_and_checks_sizes():
    a = make_mqar_batch(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    b = make_mqar_batch(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(u, w) for u, w in zip(a, b))
    with pytest.raises(ValueError, match="num_pairs"):
        make_mqar_batch(2, 9, 64, 16, generator=torch.Generator())
    with pytest.raises(ValueError, match="no room"):
        make_mqar_batch(2, 8, 17, 64, generator=torch.Generator())


def test_token_shift_is_causal_and_keeps_the_head_tied():
    cfg = MQARConfig(kind="linear", d_model=16, n_head=2, seq_len=12, vocab_size=16)
    model = build_model(cfg)
    assert model.head.weight is model.tok.weight
    x = torch.randint(0, 16, (2, 11))
    x2 = x.clone()
    x2[:, 6] = (x2[:, 6] + 1) % 16
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :6], b[:, :6])  # changing token 6 leaves earlier logits alone
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_state_numbers():
    cfg = lambda kind, **kw: MQARConfig(kind=kind, d_model=64, n_head=2, n_layer=2, seq_len=128, **kw)
    assert state_numbers(cfg("linear")) == 2 * (2 * 32 * 33)           # two layers of S and z, two heads of 32
    assert state_numbers(cfg("retnet")) == 2 * (2 * 32 * 32)           # no normaliser
    assert state_numbers(cfg("cosformer")) == 2 * (2 * 64 * 33)        # cos and sin halves
    assert state_numbers(cfg("softmax")) == 2 * (2 * 128 * 64)         # KV caches at 128 tokens
    assert state_numbers(cfg("hybrid")) == 2 * 128 * 64 + 2 * 32 * 33  # one of each


def test_quick_cli_writes_json_with_metadata(tmp_path):
    out = tmp_path / "mqar.json"
    payload = mqar.main(["--quick", "--out", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    meta = data["meta"]
    assert meta["command"].startswith("python -m linattn_lib.experiments.mqar --quick")
    for key in ("library_version", "torch_version", "hardware", "date_utc", "sweep_seconds", "seeds", "config"):
        assert key in meta
    assert {r["kind"] for r in data["results"]} == {"softmax", "linear"}
    for r in payload["results"]:
        assert set(r["accuracy"]) == {"2", "3"}  # one accuracy per evaluated pair count
        assert r["config"]["seed"] == 0 and r["config"]["steps"] == 5
        # the recorded numbers are those of this run's config (seeded: the same on a rerun),
        # and its accuracies are the model's argmax hits on evaluate's held-out batches
        cfg = MQARConfig(**r["config"])
        again, model = run(cfg, return_model=True)
        assert again["accuracy"] == r["accuracy"] and again["final_loss"] == r["final_loss"]
        for n in (2, 3):
            gen = torch.Generator().manual_seed(10_000 + 100 * cfg.seed + n)
            hits = total = 0
            with torch.no_grad():
                for _ in range(cfg.eval_batches):
                    x, y = make_mqar_batch(cfg.eval_batch_size, n, cfg.seq_len, cfg.vocab_size, generator=gen)
                    mask = y != IGNORE
                    hits += (model(x).argmax(-1)[mask] == y[mask]).sum().item()
                    total += mask.sum().item()
            assert r["accuracy"][str(n)] == round(hits / total, 4), (r["kind"], n)


def test_mixed_batch_splits_rows_over_pair_counts():
    x, y = make_mixed_batch(6, (2, 4, 6), 24, 16, generator=torch.Generator().manual_seed(0))
    assert x.shape == (6, 23)
    # rows 0-1 have 2 pairs: their first answer comes at position 4; rows 4-5 at position 12
    assert (y[:2, 4] != IGNORE).all() and (y[4:, :12] == IGNORE).all() and (y[4:, 12] != IGNORE).all()
    with pytest.raises(ValueError, match="multiple"):
        make_mixed_batch(5, (2, 4), 24, 16, generator=torch.Generator())


def test_tiny_softmax_run_learns_the_lookup():
    cfg = MQARConfig(kind="softmax", train_pairs=(2, 4), eval_pairs=(2, 4), seq_len=16, vocab_size=16, d_model=32,
                     steps=150, batch_size=32, lr=1e-2, warmup=10, eval_batches=2, eval_batch_size=64)
    r = run(cfg)
    # guessing one of the 8 values scores 1/8; guessing among the listed ones 1/2 or 1/4
    assert r["accuracy"]["4"] > 0.6, r["accuracy"]
    assert r["final_loss"] < 0.5 * r["first_loss"]


# ---------------------------------------------------------------- Zoology's task


def test_zoology_batch_queries_every_key_once_and_never_feeds_the_answer():
    """Zoology's multiquery_ar: distinct keys and values, every key queried exactly once in the
    query region, the target at a query is its key's value, and the token after a query is
    filler, not the answer; the share of answers visible before their query is about 0 there,
    while chapter 7's legacy generator shows most answers before they are asked for."""
    from linattn_lib.experiments.mqar import answer_visible_share, make_mqar_batch, make_zoology_batch

    gen = torch.Generator().manual_seed(0)
    n, L, V = 8, 128, 4096
    x, y = make_zoology_batch(64, n, L, V, generator=gen)
    assert x.shape == y.shape == (64, L)
    for row in range(64):
        keys, values = x[row, 0:2 * n:2], x[row, 1:2 * n:2]
        assert len(set(keys.tolist())) == n and len(set(values.tolist())) == n
        assert ((1 <= keys) & (keys < V // 2)).all() and (values >= V // 2).all()
        scored = (y[row] != -100).nonzero().flatten()
        assert len(scored) == n and (scored >= 2 * n).all() and ((scored - 2 * n) % 2 == 0).all()
        asked = x[row, scored]
        assert sorted(asked.tolist()) == sorted(keys.tolist())  # each key once
        lookup = dict(zip(keys.tolist(), values.tolist()))
        assert y[row, scored].tolist() == [lookup[k] for k in asked.tolist()]
    assert answer_visible_share(x, y, n) < 0.05
    legacy = make_mqar_batch(64, n, L, 128, generator=gen)
    assert answer_visible_share(*legacy, n) > 0.5


def test_zoology_gaps_follow_the_power_law():
    """With power_a = 0.01 most queries come right after the pairs; power_a = 1 spreads them
    uniformly over the query region."""
    from linattn_lib.experiments.mqar import make_zoology_batch

    def median_gap(a):
        x, y = make_zoology_batch(256, 4, 256, 4096, generator=torch.Generator().manual_seed(1), power_a=a)
        pos = (y != -100).nonzero()[:, 1].float()
        return ((pos - 8) / 2).median().item()

    # 124 slots: uniform gaps have a median near 61.5, the power law's is a few slots
    steep, uniform = median_gap(0.01), median_gap(1.0)
    assert steep < 20 and abs(uniform - 61.5) < 10


def test_zoology_batch_refuses_what_zoology_refuses():
    from linattn_lib.experiments.mqar import make_zoology_batch

    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="vocab_size"):
        make_zoology_batch(2, 4, 128, 128, generator=gen)          # vocab_size must exceed seq_len
    with pytest.raises(ValueError, match="num_pairs"):
        make_zoology_batch(2, 40, 128, 4096, generator=gen)        # 4 n > seq_len
    with pytest.raises(ValueError, match="power_a"):
        make_zoology_batch(2, 4, 128, 4096, generator=gen, power_a=0.0)


def test_a_zoology_run_trains_and_evaluates_on_its_own_task():
    from linattn_lib.experiments.mqar import MQARConfig, run

    cfg = MQARConfig(kind="linear", task="zoology", train_pairs=(2, 4), eval_pairs=(2, 4), seq_len=32,
                     vocab_size=64, d_model=16, steps=3, batch_size=4, eval_batches=1, eval_batch_size=8)
    result = run(cfg)
    assert result["config"]["task"] == "zoology" and set(result["accuracy"]) == {"2", "4"}


# ---------------------------------------------------------------- the zoology sweep


def test_zoology_answers_are_visible_only_by_chance_at_the_sweep_scale():
    """At the committed sweep's scale (32 tokens, vocabulary 256) an answer shows up before its
    query only when a random filler token happens to equal it: the measured share stays below
    the share of the vocabulary the filler before a query can cover, (seq_len - 2 n) / vocab_size.
    The legacy generator shows most answers before they are asked for."""
    from linattn_lib.experiments.mqar import answer_visible_share, make_mqar_batch, make_zoology_batch

    gen = torch.Generator().manual_seed(0)
    for n in (2, 4, 8):
        share = answer_visible_share(*make_zoology_batch(512, n, 32, 256, generator=gen), n)
        assert share < (32 - 2 * n) / 256 and share < 0.05, (n, share)
    legacy = [answer_visible_share(*make_mqar_batch(256, n, 128, 128, generator=gen), n) for n in (4, 8, 16, 32)]
    assert legacy[0] > 0.9 and legacy[-1] > 0.3 and legacy == sorted(legacy, reverse=True), legacy


def test_gla_layer_is_the_gated_recurrence():
    """The MQAR GLA layer equals S_t = diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = (q_t / sqrt(d_h)) S_t,
    per head, with g_t = logsigmoid(W_g x_t + b) / 16, before its output norm and projection."""
    from linattn_lib.experiments.mqar import GatedLinearAttention

    torch.manual_seed(0)
    layer = GatedLinearAttention(8, 2)
    x = torch.randn(3, 10, 8)
    got = layer._forward(x)
    q, k, v = layer.qkv(x).chunk(3, dim=-1)
    g = torch.nn.functional.logsigmoid(layer.gate(x)) / 16
    heads = lambda t: t.reshape(3, 10, 2, 4).transpose(1, 2)
    q, k, v, g = heads(q) / 2.0, heads(k), heads(v), heads(g)
    S, outs = torch.zeros(3, 2, 4, 4), []
    for t in range(10):
        S = g[:, :, t].exp()[..., None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    o = torch.stack(outs, dim=2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.out_norm
    want = layer.proj(o.transpose(1, 2).reshape(3, 10, 8))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_zoology_kind_builds_runs_and_counts_its_state():
    """Each kind of the zoology sweep trains a step on Zoology's task; GLA's state is S per head
    (d_head x d_head, no normaliser), like RetNet's; the model stays causal."""
    from linattn_lib.experiments.mqar import ZOOLOGY_KINDS, config_for, layer_state_numbers

    for kind in ZOOLOGY_KINDS:
        cfg = config_for(kind, task="zoology", train_pairs=(2,), eval_pairs=(2,), seq_len=16, vocab_size=32,
                         d_model=16, steps=1, batch_size=2, eval_batches=1, eval_batch_size=2)
        assert set(run(cfg)["accuracy"]) == {"2"}, kind
    cfg = config_for("gla", d_model=64, n_head=2, seq_len=128)
    assert state_numbers(cfg) == 2 * layer_state_numbers(cfg, "retnet") == 2 * (2 * 32 * 32)
    model = build_model(config_for("gla", d_model=16, seq_len=12, vocab_size=16))
    x = torch.randint(0, 16, (2, 12))
    x2 = x.clone()
    x2[:, 6] = (x2[:, 6] + 1) % 16
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :6], model(x2)[:, :6])


def test_a_stopped_sweep_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Every finished run is saved to <out>.partial; a second start trains only what is
    missing (runs whose recorded config differs count as missing), then writes <out> and
    removes the checkpoint."""
    out = tmp_path / "z.json"
    argv = ["--quick", "--task", "zoology", "--seeds", "0", "1", "--out", str(out), "--no-progress"]
    full = mqar.main(argv)
    assert not (tmp_path / "z.json.partial").exists() and len(full["results"]) == 4
    keep = [r for r in full["results"] if r["config"]["seed"] == 0]
    stale = dict(full["results"][-1], config=dict(full["results"][-1]["config"], lr=1.0))
    (tmp_path / "z.json.partial").write_text(json.dumps({"meta": full["meta"], "results": keep + [stale]}))
    trained = []
    real = mqar.run
    monkeypatch.setattr(mqar, "run", lambda cfg, **kw: trained.append((cfg.kind, cfg.seed)) or real(cfg, **kw))
    again = mqar.main(argv)
    assert sorted(trained) == [("linear", 1), ("softmax", 1)]
    assert [r["accuracy"] for r in again["results"]] == [r["accuracy"] for r in full["results"]]
    assert not (tmp_path / "z.json.partial").exists() and json.loads(out.read_text()) == json.loads(json.dumps(again))


def test_each_kind_and_width_gets_the_better_of_the_learning_rates(tmp_path):
    """With --lrs, every (kind, width) first trains on the first seed with each rate; the one
    with the higher mean accuracy (the first on a tie) is used on every seed (the trial at that
    rate is the first seed's run), and meta records every trial and the choice."""
    out = tmp_path / "lr.json"
    data = mqar.main(["--quick", "--task", "zoology", "--lrs", "1e-3", "3e-2", "--seeds", "0", "1",
                      "--out", str(out), "--no-progress"])
    meta = data["meta"]
    assert {k: set(v) for k, v in meta["lr"].items()} == {"softmax": {"16"}, "linear": {"16"}}
    for kind, widths in meta["lr"].items():
        for d, lr in widths.items():
            trials = meta["lr_selection"][kind][d]
            assert set(trials) == {"0.001", "0.03"} and all(t["cpu_seconds"] > 0 for t in trials.values())
            acc = {r: {n: v for n, v in t.items() if n != "cpu_seconds"} for r, t in trials.items()}
            mean = {r: sum(a.values()) / len(a) for r, a in acc.items()}
            assert str(lr) == max(mean, key=lambda r: (mean[r], r == "0.001"))
            runs = [r for r in data["results"] if r["kind"] == kind and r["d_model"] == int(d)]
            assert sorted(r["config"]["seed"] for r in runs) == [0, 1]
            assert all(r["config"]["lr"] == lr for r in runs)
            assert next(r for r in runs if r["config"]["seed"] == 0)["accuracy"] == acc[str(lr)]
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))


def test_a_lower_rate_is_tried_where_every_rate_stays_on_the_plateau(tmp_path):
    """--fallback-lr is tried only for a kind and width whose every --lrs trial stayed below 5x
    chance; five steps leave every model there, so here every cell tries it."""
    argv = ["--quick", "--task", "zoology", "--lrs", "1e-9", "2e-9", "--out", str(tmp_path / "f.json"),
            "--no-progress"]
    plain = mqar.main(argv)["meta"]["lr_selection"]
    assert all(set(w) == {"1e-09", "2e-09"} for k in plain.values() for w in k.values())
    meta = mqar.main(argv + ["--fallback-lr", "3e-2"])["meta"]
    for kind, widths in meta["lr_selection"].items():
        for d, trials in widths.items():
            assert set(trials) == {"1e-09", "2e-09", "0.03"}
            mean = {lr: sum(v for n, v in t.items() if n != "cpu_seconds") / 2 for lr, t in trials.items()}
            assert mean["1e-09"] < 5 * 2 / 32 and mean["2e-09"] < 5 * 2 / 32
            assert str(meta["lr"][kind][d]) == max(mean, key=lambda lr: (mean[lr], -list(mean).index(lr)))
