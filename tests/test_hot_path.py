"""The CUDA hot path, checked on CPU: what it launches, and that it never waits for the GPU.

`record_launches` (linattn_lib/experiments/launches.py) stubs the Triton launches and shows
the launchers CPU tensors as an H100/H200 would show them (132 SMs, sm_90), so the Python
that a training step runs on CUDA -- `linear_attention`, its checks, the custom ops, the
launchers, forward and backward -- runs here as it would there. With every way of reading a
tensor's value on the host (`.item()`, `bool()`, `.tolist()`, `int()`, `float()`,
`__index__`, `.cpu()`, `.to("cpu")`, `.numpy()`, and the comparisons that answer on the host:
`torch.equal`, `allclose`, `is_nonzero`) made to raise, that Python must still run to the end: on
a GPU each of those is a device-to-host synchronisation. So must it with `torch.tensor`,
`as_tensor` and `from_numpy` raising: copies from the host, which a CUDA graph cannot capture.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from linattn_lib import LinearAttentionState, linear_attention
from linattn_lib.core.triton_ops import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")

if triton_available():
    from linattn_lib.experiments.launches import Launch, record_launches

SYNCS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy")
# comparisons whose answer is a Python bool: on CUDA the host waits for it
HOST_ANSWERS = ("equal", "allclose", "is_nonzero")
# ops whose output size depends on the data: on CUDA the host waits for it (repeat_interleave
# with tensor repeats unless told its output_size)
SIZED_BY_DATA = ("nonzero", "repeat_interleave")


# tensors made from host data: on CUDA a copy from pageable host memory, which a CUDA graph
# cannot capture (the GPU check replays the op from one: gpu_extras.run_graph_benchmark)
FROM_HOST = ("tensor", "as_tensor", "from_numpy")


class HostSync(AssertionError):
    pass


def _from_host(name):
    def op(*args, **kwargs):
        raise HostSync(f"torch.{name} on the hot path (a host-to-device copy on CUDA: not capturable)")
    return op


def _sized_by_data(name, original):
    def op(*args, **kwargs):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        if name != "repeat_interleave" or (isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None):
            raise HostSync(f"{name} sized by the data on the hot path (a device-to-host sync on CUDA)")
        return original(*args, **kwargs)
    return op


@contextlib.contextmanager
def no_host_syncs(monkeypatch: pytest.MonkeyPatch):
    """Every host read of a tensor's value, and every op whose output is sized by the values,
    raises HostSync while the block runs."""
    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSync(f"Tensor.{name} on the hot path (a device-to-host sync on CUDA)")
        return method

    to = torch.Tensor.to

    def to_host(self, *args, **kwargs):  # .to("cpu"): a copy to the host (the library's
        if "cpu" in args or kwargs.get("device") == "cpu":  # .to(x.device) is a no-op there)
            raise HostSync("Tensor.to('cpu') on the hot path (a device-to-host sync on CUDA)")
        return to(self, *args, **kwargs)

    with monkeypatch.context() as m:
        for name in SYNCS:
            m.setattr(torch.Tensor, name, refuse(name))
        m.setattr(torch.Tensor, "to", to_host)
        for name in HOST_ANSWERS:
            m.setattr(torch.Tensor, name, refuse(name))
            m.setattr(torch, name, refuse(name))
        for name in SIZED_BY_DATA:
            m.setattr(torch, name, _sized_by_data(name, getattr(torch, name)))
            m.setattr(torch.Tensor, name, _sized_by_data(name, getattr(torch.Tensor, name)))
        for name in FROM_HOST:
            m.setattr(torch, name, _from_host(name))
        yield


def _inputs(decay: str | None, B=2, H=3, T=200, D=16, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, T, D, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g)
    log_decay = None
    if decay == "head":
        log_decay = -torch.rand(H, generator=g)
    elif decay == "token":
        log_decay = -torch.rand(B, H, T, generator=g)
    leaves = [x for x in (q, k, v, log_decay) if x is not None]
    for x in leaves:
        x.requires_grad_(requires_grad)
    return q, k, v, log_decay, leaves


def test_record_launches_records_and_stubs():
    q, k, v, _, _ = _inputs(None, requires_grad=False)
    with record_launches() as launches:
        o = linear_attention(q, k, v, backend="triton")
    assert [launch.name for launch in launches] == ["chunk_state_kernel", "chunk_output_kernel"]
    out = launches[1]
    assert isinstance(out, Launch) and isinstance(out.grid, tuple) and out.programs > 1
    assert out.kwargs["num_warps"] >= 1 and out.kwargs["BT"] >= 16 and out.kwargs["NORMALIZE"] is True
    assert out.args[0].data_ptr() == q.data_ptr()      # the arguments exactly as passed
    assert o.data_ptr() == out.args[8].data_ptr()       # o is the output kernel's buffer (never written)


def test_record_launches_unstubbed_runs_the_kernels():
    q, k, v, _, _ = _inputs(None, T=40, requires_grad=False)
    with record_launches(stub=False) as launches:
        o = linear_attention(q, k, v, backend="triton")
    assert [launch.name for launch in launches] == ["chunk_state_kernel", "chunk_output_kernel"]
    ref = linear_attention(q.double(), k.double(), v.double(), backend="torch")
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)


def test_record_launches_device_parameters():
    """The SM count reaches the launchers: few (batch, head) rows on many SMs split the state walk."""
    q, k, v, _, _ = _inputs(None, B=1, H=1, T=4096, D=64, requires_grad=False)
    with record_launches(sm_count=132) as many:
        linear_attention(q, k, v, backend="triton")
    with record_launches(sm_count=1) as one:
        linear_attention(q, k, v, backend="triton")
    assert "chunk_state_merge_kernel" in [launch.name for launch in many]
    assert "chunk_state_merge_kernel" not in [launch.name for launch in one]
    with record_launches(capability=(7, 5)) as turing:
        linear_attention(q.half(), k.half(), v.half(), backend="triton")
    with record_launches(capability=(9, 0)) as hopper:
        linear_attention(q.half(), k.half(), v.half(), backend="triton")
    assert [launch.kwargs for launch in turing] != [launch.kwargs for launch in hopper]


def test_device_queries_are_cached_per_cuda_device(monkeypatch):
    """The launchers' capability and SM count come from one torch.cuda query per device,
    and a stubbed device (record_launches) is never remembered as a real one."""
    from linattn_lib import kernels as K

    configs = K.configs
    asked = []

    def properties(device=None):
        asked.append(device)
        index = torch.device(device).index
        return types.SimpleNamespace(major=9, minor=index, multi_processor_count=100 + index)

    K.devices._cuda_properties_of.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        with record_launches(capability=(8, 0), sm_count=7):
            assert configs.device_capability(torch.device("cuda", 0)) == (8, 0)
            assert configs.multiprocessor_count("cuda:0") == 7
        assert asked == []
        for _ in range(3):
            assert configs.device_capability(torch.device("cuda", 0)) == (9, 0)
            assert configs.multiprocessor_count(torch.device("cuda", 0)) == 100
            assert configs.device_capability("cuda:2") == (9, 2)
        assert configs.multiprocessor_count("cuda") == 101  # the current device
        assert [torch.device(d).index for d in asked] == [0, 2, 1]
        assert configs.device_capability("cpu") is None and configs.multiprocessor_count(None) is None
    finally:
        K.devices._cuda_properties_of.cache_clear()


def test_the_sync_guard_catches_a_sync(monkeypatch):
    """The guard is live: a value check of the kind the hot path must not do is caught."""
    x, counts = torch.ones(3), torch.tensor([1, 0, 2])
    with no_host_syncs(monkeypatch), pytest.raises(HostSync):
        bool(torch.isfinite(x).all())
    with no_host_syncs(monkeypatch), pytest.raises(HostSync):
        x.sum().item()
    with no_host_syncs(monkeypatch), pytest.raises(HostSync):
        torch.repeat_interleave(torch.arange(3), counts)
    with no_host_syncs(monkeypatch):
        assert torch.repeat_interleave(torch.arange(3), counts, output_size=3).shape == (3,)
    with no_host_syncs(monkeypatch), pytest.raises(HostSync):
        x + torch.tensor([1.0, 2.0, 3.0])
    for answer_on_host in (lambda: torch.equal(x, x), lambda: x.allclose(x), lambda: torch.is_nonzero(x[:1]),
                           lambda: x.amax().to("cpu"), lambda: x.to(device="cpu")):
        with no_host_syncs(monkeypatch), pytest.raises(HostSync):
            answer_on_host()
    with no_host_syncs(monkeypatch):  # conversions that stay on the device pass
        assert x.to(x.device) is x and x.to(torch.float64).dtype == torch.float64


CASES = [(decay, normalize) for decay in (None, "head", "token") for normalize in (True, False)]


@pytest.mark.parametrize("decay,normalize", CASES)
def test_hot_path_does_not_synchronise(monkeypatch, decay, normalize):
    """Forward and backward through `linear_attention(backend="auto")` on tensors the dispatcher
    takes for CUDA, with the launches stubbed: no host read of any tensor value."""
    q, k, v, log_decay, leaves = _inputs(decay)
    with record_launches(cuda_like=True) as launches, no_host_syncs(monkeypatch):
        o = linear_attention(q, k, v, log_decay=log_decay, normalize=normalize)
        o.backward(torch.ones_like(o))
    assert all(x.grad is not None for x in leaves)
    names = [launch.name for launch in launches]
    assert "chunk_output_kernel" in names and "chunk_dqk_kernel" in names


PACKED_LENGTHS = (1, 63, 0, 65, 130)  # a sequence of one token, an empty one, chunk edges crossed


def _packed_inputs(decay: str | None, H=3, D=16):
    """Packed sequences (1, H, T_total, D) and their cu_seqlens (int32), the leaves needing grads."""
    T = sum(PACKED_LENGTHS)
    q, k, v, log_decay, leaves = _inputs(decay, B=1, H=H, T=T, D=D)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, log_decay, leaves, cu


@pytest.mark.parametrize("decay,normalize", CASES)
def test_packed_hot_path_does_not_synchronise(monkeypatch, decay, normalize):
    """Packed sequences (`cu_seqlens`) too: no host read of cu_seqlens (its values are checked
    like the other inputs' values: opt-in on CUDA), and the chunk list is sized by its bound
    ceil(T / BT) + N - 1, not by a count read back from the device. Forward and backward, with
    initial and final states (one per sequence)."""
    q, k, v, log_decay, leaves, cu = _packed_inputs(decay)
    N, H, D = cu.numel() - 1, q.shape[1], q.shape[-1]
    S0, z0 = torch.randn(N, H, D, D, requires_grad=True), torch.rand(N, H, D, requires_grad=True)
    state = LinearAttentionState(S0, z0 if normalize else None)
    with record_launches(cuda_like=True) as launches, no_host_syncs(monkeypatch):
        o, final = linear_attention(q, k, v, log_decay=log_decay, normalize=normalize, cu_seqlens=cu,
                                    initial_state=state, return_state=True)
        loss = o.sum() + final.S.sum() + (final.z.sum() if normalize else 0)
        loss.backward()
    assert final.S.shape == (N, H, D, D)
    assert all(x.grad is not None for x in leaves) and S0.grad is not None
    names = [launch.name for launch in launches]
    assert "chunk_output_kernel" in names and "chunk_dqk_kernel" in names
    assert all(launch.kwargs["IS_VARLEN"] for launch in launches if "IS_VARLEN" in launch.kwargs)
    for launch in launches:  # the parallel grids: one program per chunk slot, ceil(T / BT) + N - 1 of them
        if launch.name in ("chunk_output_kernel", "chunk_dqk_kernel", "chunk_dv_kernel"):
            assert launch.grid[1] == -(-q.shape[2] // launch.kwargs["BT"]) + N - 1, launch.name


def test_hot_path_with_states_does_not_synchronise(monkeypatch):
    """Resuming from a state and returning one (what chunked training and prefill do)."""
    q, k, v, log_decay, leaves = _inputs("token")
    B, H, _, D = q.shape
    state = LinearAttentionState(torch.randn(B, H, D, D), torch.rand(B, H, D))
    with record_launches(cuda_like=True), no_host_syncs(monkeypatch):
        o, final = linear_attention(q, k, v, log_decay=log_decay, initial_state=state, return_state=True)
        (o.sum() + final.S.sum() + final.z.sum()).backward()
    assert all(x.grad is not None for x in leaves)


def test_value_checks_on_cuda_are_opt_in(monkeypatch):
    """On CUDA the finite / sign checks are off unless asked for (CHECK_DEVICE_VALUES, or
    LINATTN_CHECK_VALUES=1); asked for, they run, and they synchronise. On CPU they always run."""
    from linattn_lib import _validate

    q, k, v, log_decay, _ = _inputs("token", requires_grad=False)
    k[0, 0, 7, 0] = float("nan")
    log_decay[0, 0, 3] = 0.5
    with record_launches(cuda_like=True), no_host_syncs(monkeypatch):
        linear_attention(q, k, v, log_decay=log_decay)            # not checked: no error, no sync
    monkeypatch.setattr(_validate, "CHECK_DEVICE_VALUES", True)
    with record_launches(cuda_like=True), pytest.raises(ValueError, match=r"`k` has a non-finite value"):
        linear_attention(q, k, v, log_decay=log_decay)
    with record_launches(cuda_like=True), no_host_syncs(monkeypatch), pytest.raises(HostSync):
        linear_attention(q, k, v, log_decay=log_decay)
    monkeypatch.setattr(_validate, "CHECK_DEVICE_VALUES", False)
    with pytest.raises(ValueError, match=r"`k` has a non-finite value \(nan\) at index \(0, 0, 7, 0\)"):
        linear_attention(q, k, v, log_decay=log_decay)             # CPU: checked
    k[0, 0, 7, 0] = 0.0
    with pytest.raises(ValueError, match=r"`log_decay` must be <= 0"):
        linear_attention(q, k, v, log_decay=log_decay)


@pytest.mark.parametrize("bad,match", [([1, 64, 64, 200], "must start at 0"), ([0, 64, 64, 199], "must end at"),
                                       ([0, 65, 64, 200], "non-decreasing")])
def test_cu_seqlens_values_on_cuda_are_opt_in(monkeypatch, bad, match):
    """cu_seqlens' values (start at 0, non-decreasing, end at T) are checked like the other
    values: always on CPU, on CUDA only when asked for (then with a sync) -- or when the
    spans are read on the host anyway (causal=False pads the sequences into batches)."""
    from linattn_lib import _validate

    q, k, v, _, _ = _inputs(None, B=1, requires_grad=False)
    cu = torch.tensor(bad, dtype=torch.int32)
    with record_launches(cuda_like=True), no_host_syncs(monkeypatch):
        linear_attention(q, k, v, cu_seqlens=cu)                  # not checked: no error, no sync
    with record_launches(cuda_like=True), pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, cu_seqlens=cu, causal=False)    # padding reads the spans: checked then
    monkeypatch.setattr(_validate, "CHECK_DEVICE_VALUES", True)
    with record_launches(cuda_like=True), pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, cu_seqlens=cu)
    with record_launches(cuda_like=True), no_host_syncs(monkeypatch), pytest.raises(HostSync):
        linear_attention(q, k, v, cu_seqlens=cu)
    monkeypatch.setattr(_validate, "CHECK_DEVICE_VALUES", False)
    with pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, cu_seqlens=cu)                  # CPU: checked


def test_packed_layout_bounds_the_chunks_without_reading_them(monkeypatch):
    """`packed_layout` sizes the chunk list by ceil(T / BT) + N - 1 without a host read; real
    chunks first, then padding slots of sequence N (cu[N + 1] = cu[N]: length 0). An unchecked
    bad cu_seqlens is clamped into [0, T] and made non-decreasing: never an index outside."""
    from linattn_lib.kernels.sequences import packed_layout

    cu = torch.tensor([0, 1, 64, 64, 129, 259], dtype=torch.int32)
    with no_host_syncs(monkeypatch):
        cu_k, offsets, indices, NT, N = packed_layout(cu, 259, 1, 3, 64)
    assert (NT, N) == (5 + 5 - 1, 5)
    assert cu_k.tolist() == [0, 1, 64, 64, 129, 259, 259] and offsets.tolist() == [0, 1, 2, 2, 4, 7]
    assert indices.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [4, 0], [4, 1], [4, 2], [5, 0], [5, 1]]
    cu_k, offsets, indices, NT, _ = packed_layout(torch.tensor([3, 500, 100, 259]), 259, 1, 3, 64)
    assert cu_k.tolist() == [3, 259, 259, 259, 259] and offsets.tolist() == [0, 4, 4, 4]
    assert NT == 5 + 2 and indices[:, 0].tolist() == [0] * 4 + [3] * 3


def test_value_screen_overflow_falls_back_to_the_exact_check():
    """The CPU screen is a sum: finite values whose sum overflows are looked at element-wise
    and pass; a single inf among them is still found and named."""
    q, k, v, _, _ = _inputs(None, requires_grad=False)
    big = torch.full_like(k, 3e38)
    linear_attention(q, big, v, backend="torch")  # finite: accepted (outputs may overflow, not refused)
    big[1, 2, 3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"`k` has a non-finite value \(inf\) at index \(1, 2, 3, 4\)"):
        linear_attention(q, big, v, backend="torch")


# the kernels each pass launches today, at the benchmark's shape (B=1 H=16 T=16384 D=128 bf16 on
# an H100/H200-like device): Triton launches and the torch ops that start a kernel of their own
FORWARD_KERNELS = {
    "normalised": ["chunk_state_kernel", "chunk_output_kernel"],
    "unnormalised, per-token decay": ["chunk_decay_kernel", "chunk_state_kernel", "chunk_output_kernel"],
    "unnormalised, per-head decay": ["chunk_decay_kernel", "chunk_state_kernel", "chunk_output_kernel"],
}
BACKWARD_KERNELS = {"normalised": 6, "unnormalised, per-token decay": 8, "unnormalised, per-head decay": 9}


@pytest.mark.parametrize("case", list(FORWARD_KERNELS))
def test_kernels_per_pass(case):
    """At most 6 kernels a forward (issue 30), and the backward no more than it launches now."""
    from linattn_lib.experiments.host_overhead import count

    counted = count(case)
    forward = [launch.name for launch in counted["forward"]] + counted["forward_torch"]
    backward = [launch.name for launch in counted["backward"]] + counted["backward_torch"]
    assert len(forward) <= 6
    assert forward == FORWARD_KERNELS[case]
    assert len(backward) <= BACKWARD_KERNELS[case], backward
    assert "chunk_dqk_kernel" in backward and "chunk_dv_kernel" in backward


def test_autograd_floor_runs_a_real_backward():
    """The floor host_overhead prints beside each case is a full custom-op round trip: its
    backward runs and hands every input a gradient of its own shape (so the engine's work
    for this many inputs is in the floor), and the times come back as positive medians."""
    from linattn_lib.experiments.host_overhead import _Floor, autograd_floor, make_inputs

    inputs = make_inputs("unnormalised, per-token decay", shape=(1, 2, 8, 4), dtype=torch.float32)
    args = [inputs[name] for name in ("q", "k", "v", "log_decay")]
    _Floor.apply(*args).backward(torch.ones(1, 2, 8, 4))
    assert [tuple(x.grad.shape) for x in args] == [tuple(x.shape) for x in args]
    times = autograd_floor("normalised", calls=3, shape=(1, 2, 8, 4))
    assert set(times) == {"forward", "fwd+bwd"} and all(t > 0 for t in times.values())


def test_compiled_call_runs_the_eager_launchers():
    """What host_overhead prints for torch.compile is the same work as eager, compiled: one
    compiled forward+backward launches exactly the Triton kernels an eager one launches (the
    custom ops run the same launchers), and the medians come back positive."""
    from linattn_lib.experiments.host_overhead import compiled_host_time, count

    case, shape = "unnormalised, per-token decay", (1, 2, 256, 32)
    counted = count(case, shape)
    eager = [launch.name for launch in counted["forward"] + counted["backward"]]
    compiled = compiled_host_time(case, calls=3, shape=shape)
    assert compiled["launches"] == eager and "decay_grad_kernel" in eager
    assert compiled["forward"] > 0 and compiled["fwd+bwd"] > 0


def test_stub_time_replays_the_recorded_launches():
    """The stub's own cost that host_overhead prints is the recorded launches replayed under
    the stub: each replay records the same kernel and grid again, nothing for no launches,
    and a positive median that grows with the launches replayed."""
    from linattn_lib.experiments import host_overhead as ho

    counted = ho.count("unnormalised, per-token decay", (1, 2, 256, 32))
    launches = counted["forward"] + counted["backward"]
    with ho.record_launches(cuda_like=True, keep_args=False) as again:
        for x in launches:
            x.fn[x.grid](*(None,) * sum(p not in x.kwargs for p in x.fn.arg_names), **x.kwargs)
    assert [(x.name, x.grid) for x in again] == [(x.name, x.grid) for x in launches]
    assert ho.stub_time([], calls=5) < ho.stub_time(launches * 20, calls=5)


def test_triton_run_time_goes_through_tritons_run_and_restores_it():
    """Triton's own launch path that host_overhead prints: the recorded launches really pass
    through JITFunction.run's binder (a launch missing an argument raises there, and is reported
    as None, not timed), nothing compiles, and the driver and the kernels' caches are as they
    were afterwards."""
    from triton.runtime.driver import driver

    from linattn_lib.experiments import host_overhead as ho

    case, shape = "unnormalised, per-token decay", (1, 2, 256, 32)
    inputs = ho.make_inputs(case, shape)
    with ho.record_launches(cuda_like=True) as launches:
        ho._forward(inputs)
    fns = {x.fn for x in launches}
    before = driver._active, {fn: dict(fn.device_caches) for fn in fns}
    one, three = ho.triton_run_time(launches[:1], calls=5), ho.triton_run_time(launches * 3, calls=5)
    assert one is not None and three is not None and 0 < one < three
    broken = [ho.Launch(x.name, x.fn, x.grid, x.args[:-1], x.kwargs) for x in launches]
    assert ho.triton_run_time(broken, calls=5) is None
    assert (driver._active, {fn: dict(fn.device_caches) for fn in fns}) == before
    times = ho.triton_time(case, calls=3, shape=shape)
    assert set(times) == {"forward", "fwd+bwd"} and 0 < times["forward"] < times["fwd+bwd"]
