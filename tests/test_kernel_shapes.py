"""The launchers in `linattn_lib.kernels` refuse arguments whose shapes their kernels would
read or write outside of (kernels/shapes.py).

Every case here ran before the checks: the Triton interpreter read NaN from past the end of a
guard buffer, or crashed writing past a tensor, or the result was silently wrong (a state
transposed, a log-decay laid out (B, T, H)). On a GPU those are corrupted memory or an
illegal-address error. Each must now raise a ValueError or TypeError naming the argument,
before anything is launched (`record_launches` sees no launch).
"""
from __future__ import annotations

import pytest
import torch

from linattn_lib import kernels as K
from linattn_lib.experiments.launches import record_launches

B, H, T, DK, DV = 2, 2, 40, 16, 32


def _rand(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=GEN) * 0.5 + 0.1


GEN = torch.Generator().manual_seed(0)
q, k = _rand(B, H, T, DK), _rand(B, H, T, DK)
v = _rand(B, H, T, DV)
S0, z0 = _rand(B, H, DK, DV), _rand(B, H, DK)
g = -_rand(B, H, T) / 5
do, o, den = _rand(B, H, T, DV), _rand(B, H, T, DV), _rand(B, H, T) + 1
dS, dz = _rand(B, H, DK, DV), _rand(B, H, DK)
cu = torch.tensor([0, 17, 40], dtype=torch.int32)
qp, kp, vp = q[:1], k[:1], v[:1]  # two packed sequences of 17 and 23 tokens
q1, k1, v1 = q[:, :, 0], k[:, :, 0], v[:, :, 0]


def _bwd(**kw):
    args = dict(q=q, k=k, v=v, do=do, o=o, den=den)
    args.update(kw)
    return K.chunk_bwd_two_phase(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("do"), **args)


CASES = {
    # the forward, one pass and two phases
    "S0 transposed": lambda: K.chunk_fwd(q, k, v, initial_state=(S0.mT.contiguous(), z0)),
    "S0 without its batch dim": lambda: K.chunk_fwd_two_phase(q, k, v, initial_state=(S0[0], z0)),
    "z0 without its batch dim": lambda: K.chunk_fwd(q, k, v, initial_state=(S0, z0[0])),
    "k shorter than q": lambda: K.chunk_fwd(q, k[:, :, :-8], v),
    "k of batch 1": lambda: K.chunk_fwd_two_phase(q, k[:1], v),
    "v of one head": lambda: K.chunk_fwd_two_phase(q, k, v[:, :1]),
    "k wider than q": lambda: K.chunk_fwd(q, _rand(B, H, T, 32), v),
    "k of another dtype": lambda: K.chunk_fwd_two_phase(q, k.half(), v),
    "log_decay laid out (B, T, H)": lambda: K.chunk_fwd_two_phase(q, k, v, log_decay=g.transpose(1, 2)),
    "log_decay one token short": lambda: K.chunk_fwd(q, k, v, log_decay=g[:, :, :-1]),
    "log_decay (B, H)": lambda: K.chunk_fwd(q, k, v, log_decay=g[:, :, 0]),
    "states shorter than v": lambda: K.chunk_states(k, v[:, :, :-8]),
    "key_scale one token short": lambda: K.chunk_states(q, do, reverse=True, key_scale=den[:, :, 1:]),
    "entry states of other chunks": lambda: K.chunk_output(q, k, v, torch.empty(B, H, 1, DK, DV),
                                                           torch.empty(B, H, 1, DK)),
    # packed sequences
    "dead tail of packed sequences": lambda: _bwd(q=qp, k=kp, v=vp, do=do[:1], o=None, den=None,
                                                  cu_seqlens=cu, skip_dead_tail=True),
    "lengths with packed sequences": lambda: K.chunk_states(kp, vp, cu_seqlens=cu,
                                                            lengths=torch.full((1, H), T, dtype=torch.int32)),
    "one initial state for two sequences": lambda: K.chunk_fwd_two_phase(
        qp, kp, vp, cu_seqlens=cu, initial_state=(S0[:1], z0[:1])),
    "cu_seqlens with a batch of 2": lambda: K.chunk_fwd_two_phase(q, k, v, cu_seqlens=cu),
    "cu_seqlens of floats": lambda: K.chunk_fwd_two_phase(qp, kp, vp, cu_seqlens=cu.float()),
    # the backward
    "final_state_grad transposed": lambda: _bwd(final_state_grad=(dS.mT.contiguous(), dz)),
    "final_state_grad without its batch dim": lambda: _bwd(final_state_grad=(dS[0], dz)),
    "den one token short": lambda: _bwd(den=den[:, :, :-1]),
    "do shorter than q": lambda: _bwd(do=do[:, :, :-8]),
    "do of another dtype": lambda: _bwd(do=do.half()),
    "log_decay_end (H,)": lambda: _bwd(log_decay=g, log_decay_end=_rand(H)),
    "den laid out (B, T, H)": lambda: K.chunk_bwd_prep(do, o, den.transpose(1, 2)),
    "end of decay_grad (H,)": lambda: K.decay_grad(_rand(1, B, H, T), _rand(H)),
    "chunk_decays one token short": lambda: K.chunk_decays(g[:, :, :-1], B, H, T, 32),
    # one step of decoding
    "decode: S transposed": lambda: K.decode_step(q1, k1, v1, S0.mT.contiguous(), z0.clone()),
    "decode: S not contiguous": lambda: K.decode_step(q1, k1, v1, S0.mT.contiguous().mT, z0.clone()),
    "decode: S without its batch dim": lambda: K.decode_step(q1, k1, v1, S0[0].clone(), z0.clone()),
    "decode: z without its batch dim": lambda: K.decode_step(q1, k1, v1, S0.clone(), z0[0].clone()),
    "decode: log_decay (1, H)": lambda: K.decode_step(q1, k1, v1, S0.clone(), z0.clone(), log_decay=g[:1, :, 0]),
    # non-causal
    "non-causal S0 transposed": lambda: K.noncausal_state(k, v, track_z=True, initial_state=(S0.mT.contiguous(), z0)),
    "non-causal v shorter than k": lambda: K.noncausal_state(k, v[:, :, :-8], track_z=False),
    "non-causal S narrower than q": lambda: K.noncausal_output(q, S0[:, :, :8]),
    "FAVOR+ with no features": lambda: K.favor_features(q, torch.empty(0, DK)),
}


LAUNCHERS = {"chunk_fwd", "chunk_fwd_two_phase", "chunk_states", "chunk_output", "chunk_bwd_two_phase",
             "chunk_bwd_prep", "decay_grad", "chunk_decays", "decode_step", "noncausal_state",
             "noncausal_output", "favor_features"}


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_shape_is_refused_before_any_launch(case):
    with record_launches() as launches, pytest.raises((ValueError, TypeError)) as info:
        CASES[case]()
    assert launches == [], f"{case}: launched {[x.name for x in launches]} before refusing"
    assert str(info.value).split(":")[0] in LAUNCHERS, str(info.value)  # names the launcher called


def test_right_shapes_pass_the_checks():
    """The checks refuse nothing that the kernels take: every launcher above with its
    documented shapes (the interpreter runs them; values are tested elsewhere)."""
    o2, den2, S_T, z_T = K.chunk_fwd_two_phase(q, k, v, log_decay=g, initial_state=(S0, z0),
                                               store_final_state=True)
    K.chunk_fwd_two_phase(qp, kp, vp, cu_seqlens=cu, initial_state=(S0, z0), log_decay=g[:1])
    grads = K.chunk_bwd_two_phase(q, k, v, do, o=o2, den=den2, log_decay=g, initial_state=(S0, z0),
                                  final_state_grad=(dS, dz), log_decay_end=_rand(B, H),
                                  need_initial_state_grad=True)
    assert grads["dq"].shape == q.shape and grads["dS0"].shape == S0.shape
    K.decode_step(q1, k1, v1, S0.clone(), z0.clone(), log_decay=g[:, :, 0])
    S, z = K.noncausal_state(k, v, track_z=True, initial_state=(S0, z0))
    K.noncausal_output(q, S, z=z)


GRID_CALLS = {
    "forward": lambda: K.chunk_fwd_two_phase(q, k, v, log_decay=g),
    "packed": lambda: K.chunk_fwd_two_phase(qp, kp, vp, cu_seqlens=cu),  # 2 sequences x 2 heads
    "backward": lambda: _bwd(),
    "noncausal": lambda: K.noncausal_state(k, v, track_z=True),
    "favor": lambda: K.favor_features(q, _rand(8, DK)),
    "delta rule": lambda: K.delta_rule_fwd(q, k, v, _rand(B, H, T)),
}


@pytest.mark.parametrize("call", GRID_CALLS)
def test_a_grid_past_cudas_limit_is_refused(call, monkeypatch):
    """CUDA launches at most 65535 programs along a grid's second and third axes, where the
    launchers put batch x heads (or packed sequences x heads, or chunks); past it a launch fails
    on a GPU, and the interpreter has no such limit. With the limit lowered to 3, every call
    here (B x H = 4) is refused with a message before any launch, as a GPU call with 65536 rows
    is (a hardware review found nothing refusing them)."""
    from linattn_lib.kernels import shapes

    monkeypatch.setattr(shapes, "MAX_GRID_YZ", 3)
    with record_launches() as launches, pytest.raises(ValueError, match="CUDA's limit"):
        GRID_CALLS[call]()
    assert launches == []


def test_cudas_grid_limit_itself():
    from linattn_lib.kernels.shapes import checked_grid

    assert checked_grid("f", 2**31 - 1, 65535, 65535) == (2**31 - 1, 65535, 65535)
    with pytest.raises(ValueError, match=r"f: a grid of \(1, 65536\) programs"):
        checked_grid("f", 1, 65536)
