"""Sequence-parallel linear attention on torch.distributed (gloo, local CPU processes).

Starting processes is the slow part, so each launched group runs a batch of checks. The
first launch starts the forkserver (one torch import); later launches fork from it.
"""
import time

import pytest
import torch

from linattn_lib import linear_attention
from linattn_lib.distributed import (
    CommLog,
    DistributedRunError,
    check_rank,
    compare_with_reference,
    failing_rank,
    launch,
    linear_sp_bytes_per_rank,
    local_state,
    main,
    make_inputs,
    prefix_states,
    prefix_states_backward,
    ring_attention_bytes_per_rank,
    sequence_parallel_linear_attention,
    shard_sequence,
    split_sequence,
)
from linattn_lib.attention import LinearAttentionState

F64, F32 = torch.float64, torch.float32

# (case, tolerance): T divisible and not, a slice that is empty (T < W), decay per token /
# per head / none, with and without the normaliser, float64 and float32, and ring attention.
CASES = [
    (dict(seq_len=37, batch=2, heads=2, dk=5, dv=3, decay="token", dtype=F64), 1e-12),
    (dict(seq_len=40, batch=1, heads=3, dk=4, dv=6, decay="head", dtype=F64, normalize=False), 1e-12),
    (dict(seq_len=3, batch=1, heads=2, dk=4, dv=4, decay="token", dtype=F64), 1e-12),
    (dict(seq_len=66, batch=1, heads=2, dk=8, dv=8, decay=None, dtype=F32), 2e-5),
    (dict(seq_len=129, batch=1, heads=2, dk=16, dv=8, decay="token", dtype=F32), 2e-5),
    (dict(seq_len=37, batch=2, heads=2, dk=5, dv=3, decay="token", dtype=F64, kind="linear_ring"), 1e-12),
    (dict(seq_len=3, batch=1, heads=2, dk=4, dv=4, decay="head", dtype=F64, kind="linear_ring",
          normalize=False), 1e-12),
    (dict(seq_len=45, batch=1, heads=2, dk=6, dv=5, decay=None, dtype=F64, kind="ring"), 1e-12),
    (dict(seq_len=3, batch=1, heads=1, dk=4, dv=4, decay=None, dtype=F64, kind="ring"), 1e-12),
]


# ---------------------------------------------------------------------------- no processes


def test_split_sequence_is_contiguous_and_balanced():
    for T in (0, 1, 3, 7, 64, 101):
        for W in (1, 2, 3, 4, 8):
            b = split_sequence(T, W)
            assert b[0][0] == 0 and b[-1][1] == T and len(b) == W
            assert all(b[i][1] == b[i + 1][0] for i in range(W - 1))
            sizes = [s - a for a, s in b]
            assert max(sizes) - min(sizes) <= 1
    x = torch.arange(10).view(1, 1, 10, 1)
    assert torch.cat([shard_sequence(x, r, 3) for r in range(3)], dim=2).equal(x)
    with pytest.raises(ValueError, match="world_size"):
        split_sequence(4, 0)


@pytest.mark.parametrize("decay", [None, "head", "token"])
@pytest.mark.parametrize("normalize", [True, False])
def test_scan_over_simulated_ranks_equals_one_pass(decay, normalize):
    """Local states -> prefix_states -> each slice resumed from its state == the whole sequence."""
    W = 4
    inp = make_inputs(23, batch=2, heads=2, dk=3, dv=4, decay=decay, dtype=F64)
    g = inp["log_decay"]
    slices = [{n: (shard_sequence(x, r, W) if x is not None and (n != "log_decay" or x.dim() == 3) else x)
               for n, x in inp.items()} for r in range(W)]
    states = [local_state(s["k"], s["v"], s["log_decay"], normalize=normalize) for s in slices]
    S_in, z_in = prefix_states(torch.stack([s[0] for s in states]), torch.stack([s[2] for s in states]),
                               torch.stack([s[1] for s in states]) if normalize else None)
    outs = [linear_attention(s["q"], s["k"], s["v"], normalize=normalize, log_decay=s["log_decay"],
                             initial_state=LinearAttentionState(S_in[r], z_in[r] if normalize else None))
            for r, s in enumerate(slices)]
    full, final = linear_attention(inp["q"], inp["k"], inp["v"], normalize=normalize, log_decay=g, return_state=True)
    assert torch.allclose(torch.cat(outs, dim=2), full, rtol=1e-12, atol=1e-12)
    # the state leaving the last rank is the state of the whole sequence
    S_last = torch.exp(states[-1][2])[..., None, None] * S_in[-1] + states[-1][0]
    assert torch.allclose(S_last, final.S, rtol=1e-12, atol=1e-12)


def test_reverse_scan_matches_autograd():
    torch.manual_seed(0)
    W, B, H, Dk, Dv = 5, 2, 3, 4, 2
    S = torch.randn(W, B, H, Dk, Dv, dtype=F64, requires_grad=True)
    z = torch.randn(W, B, H, Dk, dtype=F64, requires_grad=True)
    G = (-torch.rand(W, B, H, dtype=F64)).requires_grad_(True)
    S_in, z_in = prefix_states(S, G, z)
    dS_in, dz_in = torch.randn_like(S_in), torch.randn_like(z_in)
    torch.autograd.backward([S_in, z_in], [dS_in, dz_in])
    dS, dG, dz = prefix_states_backward(dS_in, S_in.detach(), G.detach(), dz_in, z_in.detach())
    for got, want in ((dS, S.grad), (dz, z.grad), (dG, G.grad)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_byte_formulas():
    # ring attention: W-1 key/value slices of T/W tokens per rank
    assert ring_attention_bytes_per_rank(4096, 4, batch=1, heads=2, dk=16, dv=16) == 3 * 1024 * 2 * 32 * 4
    assert ring_attention_bytes_per_rank(4096, 1, batch=1, heads=2, dk=16, dv=16) == 0
    # uneven: rank 0 forwards every block but rank 1's
    assert ring_attention_bytes_per_rank(7, 3, batch=1, heads=1, dk=1, dv=1, bytes_per_element=1, rank=0) == 2 * (3 + 2)
    # linear: (W-1) states, whatever T is
    assert linear_sp_bytes_per_rank(4, batch=1, heads=2, dk=16, dv=16) == 3 * 2 * (256 + 16 + 1) * 4
    assert linear_sp_bytes_per_rank(4, batch=1, heads=2, dk=16, dv=16, normalize=False, backward=True) == \
        3 * 2 * (257 + 256) * 4
    # the chain of sends: one state forward (not the last rank), one backward (not rank 0)
    ring = dict(batch=1, heads=2, dk=16, dv=16, backward=True, scan="ring")
    assert [linear_sp_bytes_per_rank(4, rank=r, **ring) for r in range(4)] == [2176, 4352, 4352, 2176]


def test_needs_an_initialised_group():
    q = torch.ones(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sequence_parallel_linear_attention(q, q, q)


# ---------------------------------------------------------------------------- local process groups


def _expected_sent(case, W, rank):
    dims = dict(batch=case["batch"], heads=case["heads"], dk=case["dk"], dv=case["dv"],
                bytes_per_element=8 if case["dtype"] == F64 else 4, rank=rank)
    if case.get("kind") == "ring":
        return ring_attention_bytes_per_rank(case["seq_len"], W, **dims)
    scan = "ring" if case.get("kind") == "linear_ring" else "all_gather"
    if scan == "all_gather":
        dims.pop("rank")
    return linear_sp_bytes_per_rank(W, normalize=case.get("normalize", True), backward=True, scan=scan, **dims)


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_single_process(world_size):
    cases = [c for c, _ in CASES]
    results = launch(check_rank, world_size, cases, timeout=60)
    for (case, tol), errs in zip(CASES, compare_with_reference(results, cases)):
        for name, err in errs.items():
            assert err < tol, (case, name, err)
    for i, (case, _) in enumerate(CASES):
        sent = [results[r][i]["comm"]["sent"] for r in range(world_size)]
        assert sent == [_expected_sent(case, world_size, r) for r in range(world_size)], (case, sent)
        for r in range(world_size):  # the OS saw at least the payload leave (plus gloo's headers)
            os_sent = results[r][i]["comm"]["os_sent"]
            if os_sent is not None:
                calls = results[r][i]["comm"]["calls"]
                assert sent[r] <= os_sent <= sent[r] + 1024 * calls * world_size


def test_a_failing_rank_fails_every_rank_quickly():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        launch(failing_rank, 3, 1, "raise", timeout=30)
    assert time.monotonic() - t0 < 20  # the peers see the closed connection, not the 30 s timeout
    e = info.value
    assert all(code != 0 for code in e.exitcodes)
    assert str(e).startswith("3 of 3 ranks failed (first: rank 1):")
    assert e.errors[1] == "ValueError: rank 1 failed on purpose in the middle of the run"
    for r in (0, 2):
        assert e.errors[r].startswith(f"PeerFailureError: rank {r} of 3: all_gather of")
        assert "another rank of the process group probably failed" in e.errors[r]


def test_a_stalled_rank_times_out_the_others():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        launch(failing_rank, 2, 1, "stall", 60.0, 2.0, timeout=60, grace=1)
    assert time.monotonic() - t0 < 15
    e = info.value
    assert all(code != 0 for code in e.exitcodes)
    assert e.errors[0].startswith("PeerFailureError: rank 0 of 2") and "Timed out" in e.errors[0]
    assert e.errors[1].startswith("terminated by the launcher")


def test_command_line_check(capsys):
    assert main(["--nproc", "2", "--seq-len", "50", "--dk", "8", "--dv", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks, backend gloo" in out and out.rstrip().endswith("OK")
    assert main(["--nproc", "3", "--seq-len", "20", "--dk", "4", "--dv", "4", "--dtype", "float64", "--decay", "head"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_comm_log_sums():
    log = CommLog()
    assert log.sent == 0 and log.os_sent == 0 and log.summary()["calls"] == 0
