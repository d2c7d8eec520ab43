"""Sequence-parallel linear attention on torch.distributed (gloo, local CPU processes).

Starting processes is the slow part, so each launched group runs a batch of checks. The
first launch starts the forkserver (one torch import); later launches fork from it. No test
asserts a duration (machines are noisy): the failure tests check *which* error each rank
reports, which tells a peer that noticed the failure from one that timed out or was killed.
"""
import pytest
import torch

from linattn_lib import linear_attention
from linattn_lib.core.state import LinearAttentionState
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
    ring_attention,
    ring_attention_bytes_per_rank,
    sequence_parallel_linear_attention,
    shard_sequence,
    single_process_reference,
    split_sequence,
)
from linattn_lib.distributed.comm import _rank_list

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


def test_local_state_after_a_reset_is_as_precise_as_its_terms():
    """A log-decay of -1e4 early in the slice (a reset) must not cost precision later: the
    decay of key j is summed from j + 1 on. With the difference of cumulative sums,
    c_T - c_j, float32 cancels two numbers near -1e4: S is then off by about 3e-4 here."""
    B, H, T, Dk, Dv = 1, 2, 40, 3, 4
    gen = torch.Generator().manual_seed(0)
    k = torch.rand(B, H, T, Dk, generator=gen, dtype=F32) + 0.5
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=F32)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=F32) + 3.0)
    g[..., 2] = -1e4
    S, z, G = local_state(k, v, g, normalize=True)
    assert S.dtype == F32
    g64, k64, v64 = g.double(), k.double(), v.double()
    w = torch.stack([g64[..., j + 1:].sum(-1) for j in range(T)], dim=-1).exp()  # exp(g_{j+1} + ... + g_T)
    S_ref = torch.einsum("bht,bhtk,bhtv->bhkv", w, k64, v64)
    z_ref = torch.einsum("bht,bhtk->bhk", w, k64)
    for got, want in ((S, S_ref), (z, z_ref), (G, g64.sum(-1))):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6


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


# W = 2 alone cannot see the scan's decay: rank 0 enters with a zero state, so its decay
# multiplies zero, and the state rank 1 passes on is never used (nor is its gradient). From
# W = 3 on, rank 1 must decay the state it receives before passing it to rank 2.
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_equals_single_process(world_size):
    cases = [c for c, _ in CASES]
    results = launch(check_rank, world_size, cases, timeout=60)
    for (case, tol), errs in zip(CASES, compare_with_reference(results, cases)):
        for name, err in errs.items():
            assert err < tol, (case, name, err)
    # a per-head log-decay is one parameter shared by the ranks: every rank must hold its whole
    # gradient (summed over the ranks), equal to the single-process one
    for i, (case, tol) in enumerate(CASES):
        if case["decay"] != "head":
            continue
        inp = make_inputs(**{n: x for n, x in case.items() if n not in ("kind", "normalize")})
        want = single_process_reference(inp, normalize=case.get("normalize", True))["dlog_decay"]
        for r in range(world_size):
            got = results[r][i]["dlog_decay"]
            assert got.shape == want.shape, (r, case)
            assert float((got - want).abs().max() / want.abs().max()) < tol, (r, case)
    for i, (case, _) in enumerate(CASES):
        sent = [results[r][i]["comm"]["sent"] for r in range(world_size)]
        assert sent == [_expected_sent(case, world_size, r) for r in range(world_size)], (case, sent)
        for r in range(world_size):  # the OS saw at least the payload leave (plus gloo's headers)
            os_sent = results[r][i]["comm"]["os_sent"]
            if os_sent is not None:
                calls = results[r][i]["comm"]["calls"]
                assert sent[r] <= os_sent <= sent[r] + 1024 * calls * world_size


def _disagreeing_call(rank, world, cases, catch=True):
    """Rank function: call sequence_parallel_linear_attention ("linear") or ring_attention ("ring")
    once per case (function, {rank: {argument: value}}), with those ranks' arguments changed,
    and return what each call raised on this rank ("ok" if nothing). catch=False lets it raise."""
    out = []
    for function, changes in cases:
        a = dict(B=1, H=2, Dk=4, Dv=3, dtype=F64, device="cpu", decay=None, normalize=True, eps=1e-6, chunk_size=64,
                 scan="all_gather", causal=True, seq_len=3 * world, scale=None)
        a.update(changes.get(rank, {}))
        start, stop = split_sequence(a["seq_len"], world)[rank]
        T = stop - start
        x = torch.rand(a["B"], a["H"], T, a["Dk"] + a["Dk"] + a["Dv"], dtype=a["dtype"], device=a["device"])
        q, k, v = x.split([a["Dk"], a["Dk"], a["Dv"]], dim=-1)
        try:
            if function == "ring":
                ring_attention(q, k, v, seq_len=a["seq_len"], causal=a["causal"], scale=a["scale"])
            else:
                g = {None: None, "head": torch.full((a["H"],), -0.1, dtype=a["dtype"]),
                     "token": torch.full((a["B"], a["H"], T), -0.1, dtype=a["dtype"])}[a["decay"]]
                sequence_parallel_linear_attention(q, k, v, normalize=a["normalize"], log_decay=g, eps=a["eps"],
                                                   chunk_size=a["chunk_size"], scan=a["scan"])
            out.append("ok")
        except ValueError as e:
            if not catch:
                raise
            out.append(str(e))
    return out


SP, RING = "sequence_parallel_linear_attention", "ring_attention"
# (function, {rank: changed arguments}, what every rank must say) on 3 ranks
DISAGREEMENTS = [
    ("linear", {1: dict(H=3)}, f"{SP}: `q` has H=2 on ranks 0, 2 but H=3 on rank 1"),
    ("linear", {1: dict(H=3), 2: dict(H=1)}, f"{SP}: `q` has H=2 on rank 0 but H=3 on rank 1 and H=1 on rank 2"),
    ("linear", {0: dict(B=2)}, f"{SP}: `q` has B=2 on rank 0 but B=1 on ranks 1, 2"),
    ("linear", {2: dict(Dk=5)}, f"{SP}: `q` has Dk=4 on ranks 0, 1 but Dk=5 on rank 2"),
    ("linear", {1: dict(Dv=4)}, f"{SP}: `v` has Dv=3 on ranks 0, 2 but Dv=4 on rank 1"),
    ("linear", {1: dict(dtype=F32)}, f"{SP}: `q` has dtype torch.float64 on ranks 0, 2 but torch.float32 on rank 1"),
    ("linear", {1: dict(device="meta")}, f"{SP}: `q` has device type cpu on ranks 0, 2 but meta on rank 1"),
    ("linear", {1: dict(normalize=False)},
     f"{SP}: `normalize`=True on ranks 0, 2 but `normalize`=False on rank 1"),
    ("linear", {1: dict(decay="head"), 2: dict(decay="token")},
     f"{SP}: `log_decay` is None on rank 0 but per-head (H,) on rank 1 and per-token (B, H, T_r) on rank 2"),
    ("linear", {1: dict(eps=1e-3)}, f"{SP}: `eps`=1e-06 on ranks 0, 2 but `eps`=0.001 on rank 1"),
    ("linear", {1: dict(chunk_size=16)}, f"{SP}: `chunk_size`=64 on ranks 0, 2 but `chunk_size`=16 on rank 1"),
    ("linear", {2: dict(scan="ring")}, f"{SP}: `scan`='all_gather' on ranks 0, 1 but `scan`='ring' on rank 2"),
    ("linear", {1: dict(H=3, normalize=False)},
     f"{SP}: `q` has H=2 on ranks 0, 2 but H=3 on rank 1; `normalize`=True on ranks 0, 2 but `normalize`=False "
     "on rank 1"),
    ("ring", {1: dict(H=3)}, f"{RING}: `q` has H=2 on ranks 0, 2 but H=3 on rank 1"),
    ("ring", {1: dict(B=2)}, f"{RING}: `q` has B=1 on ranks 0, 2 but B=2 on rank 1"),
    ("ring", {1: dict(Dk=5, scale=0.5)}, f"{RING}: `q` has Dk=4 on ranks 0, 2 but Dk=5 on rank 1"),
    ("ring", {1: dict(Dv=4)}, f"{RING}: `v` has Dv=3 on ranks 0, 2 but Dv=4 on rank 1"),
    ("ring", {2: dict(dtype=F32)}, f"{RING}: `q` has dtype torch.float64 on ranks 0, 1 but torch.float32 on rank 2"),
    ("ring", {0: dict(device="meta")}, f"{RING}: `q` has device type meta on rank 0 but cpu on ranks 1, 2"),
    ("ring", {1: dict(causal=False)}, f"{RING}: `causal`=True on ranks 0, 2 but `causal`=False on rank 1"),
    ("ring", {1: dict(seq_len=10)}, f"{RING}: `seq_len`=9 on ranks 0, 2 but `seq_len`=10 on rank 1"),
    ("ring", {1: dict(scale=0.25)}, f"{RING}: `scale`=0.5 on ranks 0, 2 but `scale`=0.25 on rank 1"),
]


def test_arguments_that_differ_between_ranks_raise_on_every_rank():
    # Before any collective: otherwise gloo aborts the process ("Received data size doesn't
    # match expected size"), or -- when the byte counts agree -- a rank returns a wrong result.
    # Every rank raises the same error after the same one all-gather, so the group stays usable:
    # the last two calls agree (scale=None is 1/sqrt(Dk) = 0.5) and must run.
    cases = [(f, changes) for f, changes, _ in DISAGREEMENTS]
    cases += [("linear", {r: dict(decay="head") for r in range(3)}), ("ring", {1: dict(scale=0.5)})]
    got = launch(_disagreeing_call, 3, cases, timeout=60)
    for r in range(3):
        for (_, _, want), message in zip(DISAGREEMENTS, got[r]):
            assert message == f"{want}; expected the same on every rank of the process group (this is rank {r} of 3)"
        assert got[r][len(DISAGREEMENTS):] == ["ok", "ok"]


def test_disagreement_lists_ranks_compactly():
    assert _rank_list([3]) == "rank 3"
    assert _rank_list([0, 2]) == "ranks 0, 2"
    assert _rank_list([0, 1, 2, 3, 5, 6, 9]) == "ranks 0-3, 5, 6, 9"


def test_launch_reports_the_disagreement_from_every_rank():
    with pytest.raises(DistributedRunError) as info:
        launch(_disagreeing_call, 2, [("linear", {1: dict(H=3)})], False, timeout=60)
    e = info.value
    assert str(e).startswith("2 of 2 ranks failed")
    for r in range(2):
        assert e.errors[r] == (f"ValueError: {SP}: `q` has H=2 on rank 0 but H=3 on rank 1; expected the same on "
                               f"every rank of the process group (this is rank {r} of 2)")


def test_a_failing_rank_fails_every_rank():
    # The peers must notice the closed connection by themselves. The collective timeout (300 s)
    # and the grace before the launcher kills the survivors (120 s) only guard against a hang:
    # a peer that waited for the timeout would say "Timed out", one that never noticed would be
    # "terminated by the launcher".
    with pytest.raises(DistributedRunError) as info:
        launch(failing_rank, 3, 1, "raise", timeout=300, grace=120)
    e = info.value
    assert all(code != 0 for code in e.exitcodes)
    assert str(e).startswith("3 of 3 ranks failed (first: rank 1):")
    assert e.errors[1] == "ValueError: rank 1 failed on purpose in the middle of the run"
    for r in (0, 2):
        assert e.errors[r].startswith(f"PeerFailureError: rank {r} of 3: all_gather of")
        assert "another rank of the process group probably failed" in e.errors[r]
        assert "Timed out" not in e.errors[r]


def test_a_stalled_rank_times_out_the_others():
    # Rank 1 sleeps 60 s in the second step, whose collectives time out after 1 s (the start-up
    # and the first step run under the launch's 60 s). Rank 0 must report the time-out while
    # rank 1 still sleeps: without the time-out rank 1 would wake, both would finish and nothing
    # would be raised. Rank 1 is then killed by the launcher (1 s grace), not failed by itself.
    with pytest.raises(DistributedRunError) as info:
        launch(failing_rank, 2, 1, "stall", 60.0, 1.0, timeout=60, grace=1)
    e = info.value
    assert all(code != 0 for code in e.exitcodes)
    assert str(e).startswith("2 of 2 ranks failed (first: rank 0):")
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


def _penalty_rank(rank, world, scans):
    """Rank function: a gradient penalty (create_graph=True, loss linear in the output)
    through sequence-parallel attention on 3 tokens, once per scan; what each raised here."""
    out = []
    for scan in scans:
        start, stop = split_sequence(3, world)[rank]
        q, k, v = (torch.rand(1, 2, stop - start, 4, dtype=F64, requires_grad=True) for _ in range(3))
        g = torch.full((1, 2, stop - start), -0.1, dtype=F64)
        o = sequence_parallel_linear_attention(q, k, v, log_decay=g, scan=scan)
        try:
            torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
            out.append("no error")
        except NotImplementedError as e:
            out.append(str(e).split(":")[0])
    return out


def test_second_derivatives_are_refused_on_every_rank():
    """A rank whose slice is empty (T=3 on 4 ranks) meets the state scan alone in its
    backward; the scan refuses create_graph=True as the local chunked calls do, so every
    rank raises at once (none waits in a collective for a peer that already failed)."""
    results = launch(_penalty_rank, 4, ["all_gather", "ring"], timeout=60)
    for rank, said in enumerate(results):
        expected = "sequence_parallel_linear_attention" if rank == 3 else "linear_attention(form='chunked')"
        assert said == [expected, expected], (rank, said)
