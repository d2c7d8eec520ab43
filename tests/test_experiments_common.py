"""The experiment helpers: reproducible seeding, a training loop that learns, atomic JSON."""
import json

import torch

from linattn_lib.experiments.common import run_metadata, seed_everything, train, write_json
from linattn_lib.nn.models import ModelConfig, TinyLM


def test_train_lowers_loss_and_is_reproducible():
    def run():
        g = seed_everything(0)
        model = TinyLM(ModelConfig(vocab_size=8, block_size=16, n_layer=1, d_model=16, n_head=2))
        data = torch.randint(0, 8, (4, 16), generator=g)
        return train(model, lambda s: (data[:, :-1], data[:, 1:]), steps=30, lr=1e-2, warmup=5)

    a, b = run(), run()
    assert a == b
    assert a[-1] < 0.8 * a[0]


def test_ignore_index_targets_do_not_count():
    seed_everything(0)
    model = TinyLM(ModelConfig(vocab_size=8, block_size=8, n_layer=1, d_model=16, n_head=2))
    x = torch.zeros(2, 7, dtype=torch.long)
    y = torch.full((2, 7), -100)
    y[:, -1] = 3
    losses = train(model, lambda s: (x, y), steps=40, lr=3e-2, warmup=1)
    # only the last position counts: the loss is that one prediction's, and it is learned
    assert losses[-1] < 0.3 * losses[0]


def test_metadata_and_atomic_json(tmp_path):
    meta = run_metadata("linattn_lib.experiments.mqar", ["--quick"])
    assert meta["command"] == "python -m linattn_lib.experiments.mqar --quick"
    for key in ("library_version", "torch_version", "hardware", "date_utc"):
        assert meta[key]
    path = write_json(tmp_path / "r" / "out.json", {"meta": meta, "x": [1, 2]})
    assert json.loads(path.read_text())["x"] == [1, 2]
    assert not list(tmp_path.glob("r/*.tmp"))


def test_quick_runs_never_overwrite_committed_results():
    from linattn_lib.experiments.common import cli_output_path

    assert cli_output_path(None, "book/results/mqar.json", quick=True) == "book/results/mqar-quick.json"
    assert cli_output_path(None, "book/results/mqar.json", quick=False) == "book/results/mqar.json"
    assert cli_output_path("x.json", "book/results/mqar.json", quick=True) == "x.json"


def test_format_bytes_never_switches_to_scientific_notation():
    from linattn_lib.chapters.costs import format_bytes

    assert format_bytes(1000) == "1000 B" and format_bytes(1023 * 2**20) == "1023 MiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB" and format_bytes(192 * 2**30) == "192 GiB"


def test_every_experiment_cli_shares_the_output_options():
    import argparse

    from linattn_lib.experiments.common import parse_cli

    args = parse_cli(argparse.ArgumentParser(), ["--quick"], "book/results/x.json")
    assert args.quick and args.out == "book/results/x-quick.json"
    assert parse_cli(argparse.ArgumentParser(), [], "book/results/x.json").out == "book/results/x.json"


def test_run_metadata_names_the_cpu_for_cpu_experiments_on_a_gpu_machine(monkeypatch):
    """The training experiments compute on the CPU: run on Colab, their results must not say
    "Tesla T4" beside a CPU thread count."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert run_metadata("m", [])["hardware"] == "Tesla T4"
    assert "T4" not in run_metadata("m", [], device="cpu")["hardware"]
