"""Converting a softmax model (nn/converted.py, experiments/convert.py): the student layer's
forms agree, a window that covers the sequence gives back the teacher exactly, transfer trains
only the feature maps, LoRA starts as a no-op and trains only its adapters."""
from __future__ import annotations

import math

import torch

from linattn_lib.experiments import charlm, convert
from linattn_lib.nn.converted import ConvertedAttention, HedgehogFeatureMap, LoRALinear, add_lora
from linattn_lib.nn.layers import SoftmaxAttention

TEXT = "def f(x):\n    return x + 1  # a tiny corpus for fast runs\n" * 40


def _teacher_layer(d=16, h=2):
    torch.manual_seed(0)
    return SoftmaxAttention(d, h).double()


def _x(T=12, d=16, B=2):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_feature_map_starts_as_softmax_of_x_and_of_minus_x():
    phi = HedgehogFeatureMap(2, 4).double()
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    assert torch.allclose(phi(x), torch.cat([x.softmax(-1), (-x).softmax(-1)], -1), atol=1e-15)
    assert HedgehogFeatureMap(2, 4, feature_dim=6).weight.shape == (2, 4, 6)


def test_linear_student_forms_agree():
    s = ConvertedAttention(_teacher_layer(), window=0).double()
    x = _x()
    a = s.weights(x)
    assert torch.triu(a, 1).abs().max() == 0 and (a >= 0).all()
    assert (a.sum(-1) - 1).abs().max() < 1e-4  # the normalisation's eps
    q, k, v = s._qkv(x)
    by_weights = s.proj((a @ v).transpose(1, 2).reshape(x.shape))
    assert (s(x) - by_weights).abs().max() < 1e-12
    y1, st = s(x[:, :5], return_state=True)
    y2 = s(x[:, 5:], state=st, pos_offset=5)
    assert (torch.cat([y1, y2], 1) - s(x)).abs().max() < 1e-12


def test_a_window_over_the_whole_sequence_is_the_teacher():
    t = _teacher_layer()
    x = _x(T=10)
    s = ConvertedAttention(t, window=10).double()
    assert (s.weights(x) - convert.softmax_weights(t, x)).abs().max() < 1e-13
    assert (s(x) - t(x)).abs().max() < 1e-13
    assert convert.transfer_loss(t, s, x, "output_mse") < 1e-26
    a = convert.softmax_weights(t, x)
    entropy = -(a * a.clamp_min(1e-300).log()).sum(-1).mean()
    assert abs(convert.transfer_loss(t, s, x, "attention_ce") - entropy) < 1e-12


def test_window_student_mixes_softmax_near_and_features_far():
    t = _teacher_layer()
    x = _x(T=9)
    s = ConvertedAttention(t, window=3).double()
    with torch.no_grad():
        s.log_mix.fill_(0.7)
    q, k, _ = s._qkv(x)
    i = 8  # query 8: keys 6..8 by softmax, keys 0..5 through the feature maps
    soft = torch.exp((q[..., i, None, :] @ k[..., 6:9, :].transpose(-1, -2)).squeeze(-2) / 8 ** 0.5)
    far = (s.phi_q(q[..., i:i + 1, :]) @ s.phi_k(k[..., :6, :]).transpose(-1, -2)).squeeze(-2)
    far = far * math.exp(0.7)
    row = torch.cat([far, soft], -1)
    row = row / row.sum(-1, keepdim=True)
    assert (s.weights(x)[..., i, :9] - row).abs().max() < 1e-12


def test_lora_starts_as_the_base_and_trains_only_adapters():
    base = torch.nn.Linear(6, 5).double()
    lora = LoRALinear(base, rank=2, generator=torch.Generator().manual_seed(0)).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(lora(x), base(x))
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["down", "up"]
    s = ConvertedAttention(_teacher_layer(), window=0)
    assert len(add_lora(s, rank=2)) == 4 and isinstance(s.qkv, LoRALinear)


def _tiny():
    data = charlm.CharData(TEXT)
    cfg = convert.ConvertConfig(ctx=16, d_model=16, n_layer=2, n_head=2, tokens_per_step=64, teacher_steps=20,
                                transfer_steps=25, finetune_steps=5, warmup=2)
    return data, cfg


def test_transfer_trains_only_the_feature_maps_and_lowers_its_loss():
    data, cfg = _tiny()
    teacher, _ = convert.train_teacher(cfg, data)
    before = {n: p.clone() for n, p in teacher.state_dict().items()}
    student = convert.convert(teacher)
    frozen = {n: p.clone() for n, p in student.named_parameters() if ".phi_" not in n}
    losses = convert.transfer(teacher, student, data, cfg, loss="attention_ce")
    assert sum(losses[-5:]) < sum(losses[:5])
    assert all(torch.equal(p, frozen[n]) for n, p in student.named_parameters() if ".phi_" not in n)
    assert any(not torch.equal(p, torch.eye(8).repeat(2, 1, 1)) for n, p in student.named_parameters()
               if n.endswith("phi_q.weight"))
    assert all(torch.equal(p, before[n]) for n, p in teacher.state_dict().items())
    # the converted model is a recurrent one: token by token equals the parallel form
    x, _ = data.batch(1, 16, generator=torch.Generator().manual_seed(0))
    assert (student.stepwise_logits(x) - student(x)).abs().max() < 1e-4


def test_finetune_changes_only_adapters(tmp_path):
    data, cfg = _tiny()
    teacher, result = convert.train_teacher(cfg, data)
    convert.save_teacher(tmp_path / "t.pt", teacher, cfg, data, result)
    loaded, cfg2, saved = convert.load_teacher(tmp_path / "t.pt")
    assert cfg2 == cfg and saved["chars"] == data.chars
    student = convert.convert(loaded)
    maps = {n: p.clone() for n, p in student.named_parameters()}
    convert.finetune(student, data, cfg)
    old = lambda n: n.replace(".base.", ".")  # LoRA wraps a projection: qkv.weight -> qkv.base.weight
    changed = {n for n, p in student.named_parameters() if old(n) not in maps or not torch.equal(p, maps[old(n)])}
    assert changed and all(n.endswith((".down", ".up")) for n in changed)


def test_quick_cli_run(tmp_path):
    out = tmp_path / "convert.json"
    payload = convert.main(["--quick", "--out", str(out), "--no-progress"])
    assert [r["method"] for r in payload["results"]] == [*convert.METHODS, "scratch", "scratch_budget"]
    steps = {r["method"]: r.get("steps") for r in payload["results"]}
    assert steps["scratch"] == 3 + 2 + 2 and steps["scratch_budget"] == 2 + 2
    assert (tmp_path / "convert.pt").exists() and not (tmp_path / "convert.json.partial").exists()
    assert set(payload["results"][0]["bpc"]) == {"swap", "transfer", "lora"}


def test_committed_sweep_is_complete_and_its_teacher_loads():
    from linattn_lib.results import load_result, result_path

    conv = load_result("convert.json")
    cfg = convert.ConvertConfig(**conv["meta"]["config"])
    assert cfg == convert.ConvertConfig()  # the library's defaults are the committed settings
    runs = {(r["method"], r["seed"]) for r in conv["results"]}
    assert runs == {(m, s) for m in [*convert.METHODS, *convert.SCRATCH] for s in (0, 1, 2)}
    for r in conv["results"]:
        assert all(2.0 < v < 8.0 for v in r["bpc"].values()), r["bpc"]
    teacher, tcfg, saved = convert.load_teacher(result_path("convert_teacher.pt"))
    assert tcfg.teacher_config() == cfg.teacher_config()
    assert saved["result"]["bits_per_char"] == conv["teacher"]["bits_per_char"]
    assert teacher.num_parameters() == saved["result"]["parameters"]
    assert result_path("convert_teacher.pt").stat().st_size < 5 * 2**20
