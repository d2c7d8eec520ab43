"""Host overhead of the CUDA hot path, counted without a GPU: launches and Python time per call.

    python -m linattn_lib.experiments.host_overhead [--shape B H T D] [--calls N] [--json PATH]

For `linear_attention` at the benchmark shape (B=1, H=16, T=16384, D=128, bfloat16) in three
variants -- normalised without decay; unnormalised with a per-token decay (Mamba-2 / GLA
style); unnormalised with a per-head decay (RetNet) -- it prints

* the kernels a forward and a forward+backward launch: every Triton launch with its grid
  (`record_launches`, launches.py), and every torch op that would start a kernel of its own
  on CUDA (a fill, a copy, a reduction; views and empty allocations start none), found by
  the torch profiler as the leaves of the op tree;
* the host time per call, the median of many calls, with the Triton launches stubbed out:
  the Python of `linear_attention`, its checks, the custom ops, the autograd engine and the
  launchers (config lookups, allocations, argument lists), all of which a GPU waits on when
  it is faster than they are;
* beside it, torch's floor for the same inputs: a custom autograd op that only allocates its
  output and gradients (`_Floor`), timed the same way. That much any autograd op with these
  inputs pays (Function.apply, the graph, the engine, `Tensor.backward`); the rest is the
  library's, less
* what the stubbed launches themselves cost (`stub_time`: the recorded launches replayed
  under the stub), which is in the host time too; on a GPU machine Triton's own launch path
  takes its place:
* Triton's own launch path (`triton_run_time`): the same launches through the real
  `JITFunction.run`, with a stand-in driver and a kernel cache that returns a no-op kernel.
  Binding and specialising 8 to 28 arguments and forming the cache key costs 10 to 23 us a
  launch on a 2-core cloud CPU, as much again as the library's own Python per launch.

Everything runs on CPU tensors dressed as CUDA ones (`record_launches(cuda_like=True)`: the
launchers see an H100/H200, 132 SMs, sm_90; the library takes its CUDA branches). The data
is never read, only the shapes matter. Two differences from a GPU machine: a
torch allocation here is the CPU allocator's (large buffers are fresh pages from the
operating system; CUDA's caching allocator hands back a cached block in about a
microsecond), and a Triton launch's own cost is not in the stubbed time: its Python is timed apart
(`triton_run_time`, above), its C launcher and driver call (a few us each) are not.

What torch.compile removes is measured too: the same call compiled with
`torch.compile(fullgraph=True)` (inductor), timed the same way (`compiled_host_time`). The
compiled graph drops the Python of `linear_attention` and its checks, but it calls the kernels
through the custom ops (`torch.ops.linattn.*`, which have the fake implementations tracing
needs), and a custom op's body runs eagerly: its launchers' config lookups, allocations and
launches all stay. On top come the custom-op dispatch (twice, forward and backward) and
AOTAutograd's runtime wrappers, which the eager path avoids with a plain autograd.Function
(`triton_ops._CausalEager`). So compiling the op alone removes no host time; it adds some (the
printout says how much). What does remove it is a CUDA graph (`torch.cuda.graphs`, or
compile's mode="reduce-overhead"): a replay is one launch of the whole graph, so all of the
host time below and every per-launch cost go, leaving the kernels' own time. That needs a GPU:
the GPU check times the op as called and replayed from a CUDA graph
(`gpu_extras.run_graph_benchmark`). The hot path allows capture: it has no host syncs, makes
no tensor from host data and has no data-dependent shapes (outside packed sequences, whose
chunk count sizes the state buffers); tests/test_hot_path.py holds it to the first two.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from ..core.linear import linear_attention
from .launches import Launch, record_launches

SHAPE = (1, 16, 16384, 128)  # B, H, T, D: the benchmark's shape (bench.py, gpu_check.py)
DTYPE = torch.bfloat16
# name -> (normalize, log-decay kind)
CASES = {
    "normalised": (True, None),
    "unnormalised, per-token decay": (False, "token"),
    "unnormalised, per-head decay": (False, "head"),
}
# aten ops that start no kernel on CUDA: allocations and views (and the wrappers whose work,
# when there is any, is a child op such as copy_ or clone)
NO_KERNEL = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::detach", "aten::alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
    "aten::contiguous", "aten::to", "aten::_to_copy", "aten::clone", "aten::set_", "aten::unbind",
    "aten::split", "aten::chunk", "aten::_unsafe_view", "aten::view_as", "aten::expand_as", "aten::result_type",
    "aten::is_nonzero", "aten::size", "aten::stride", "aten::numel", "aten::zeros_like", "aten::zeros",
    "aten::ones_like", "aten::ones", "aten::full", "aten::full_like", "aten::new_zeros", "aten::new_ones",
}


def cache_cpu_allocations() -> bool:
    """Make large CPU allocations cheap, as CUDA's caching allocator makes GPU ones: glibc
    then serves every malloc from its heap and keeps freed memory for reuse (M_MMAP_MAX = 0,
    M_TRIM_THRESHOLD = 2^31 - 1) instead of asking the kernel for fresh pages each time (about
    15 us an allocation at this shape). Process-wide and permanent; True if it took effect
    (glibc only)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, ctypes.c_int(2**31 - 1)))
    except (OSError, AttributeError):
        return False


def make_inputs(case: str, shape: tuple[int, int, int, int] = SHAPE, dtype: torch.dtype = DTYPE) -> dict:
    """linear_attention's arguments for `case`: uninitialised CPU tensors of the right shapes
    (requires_grad set), never read under the stub."""
    B, H, T, D = shape
    normalize, decay = CASES[case]
    q, k, v = (torch.empty(B, H, T, D, dtype=dtype).requires_grad_() for _ in range(3))
    log_decay = None
    if decay == "token":  # float32, as models compute it (a bf16 one adds a conversion kernel a pass)
        log_decay = torch.empty(B, H, T, dtype=torch.float32).requires_grad_()
    elif decay == "head":
        log_decay = torch.empty(H, dtype=torch.float32).requires_grad_()
    return dict(q=q, k=k, v=v, log_decay=log_decay, normalize=normalize)


def _forward(inputs: dict) -> torch.Tensor:
    return linear_attention(**inputs)


def _on_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None,
                normalize: bool) -> torch.Tensor:
    # backend named: a compiled trace reads the device from its fake tensors (CPU here), which
    # record_launches' cuda_like cannot dress up, and "auto" would pick the torch path
    return linear_attention(q, k, v, log_decay=log_decay, normalize=normalize, backend="triton")


def _fwd_bwd(inputs: dict, do: torch.Tensor, fn: Callable[..., torch.Tensor] = linear_attention) -> None:
    for name in ("q", "k", "v", "log_decay"):  # as optimizer.zero_grad(set_to_none=True) leaves them
        if inputs[name] is not None:
            inputs[name].grad = None
    fn(**inputs).backward(do)


def torch_kernels(fn: Callable[[], object]) -> list[str]:
    """The torch ops `fn` runs that would start a kernel on CUDA: the leaves of the profiler's
    op tree that are neither an allocation nor a view (NO_KERNEL)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = []
    for event in prof.events():
        name = event.name
        if name.startswith("aten::") and not event.cpu_children and name not in NO_KERNEL:
            out.append(name)
    return out


def count(case: str, shape: tuple[int, int, int, int] = SHAPE, dtype: torch.dtype = DTYPE) -> dict:
    """{"forward": launches, "backward": launches, "forward_torch": ops, "backward_torch": ops}
    of one forward and one backward (Triton launches as `Launch`es, torch ops by name)."""
    inputs = make_inputs(case, shape, dtype)
    out = {}
    with record_launches(cuda_like=True, keep_args=False) as launches:
        holder = {}
        out["forward_torch"] = torch_kernels(lambda: holder.setdefault("o", _forward(inputs)))
        out["forward"] = list(launches)
        del launches[:]
        o = holder["o"]
        do = torch.empty_like(o)
        out["backward_torch"] = torch_kernels(lambda: o.backward(do))
        out["backward"] = list(launches)
    return out


def host_time(case: str, calls: int = 200, shape: tuple[int, int, int, int] = SHAPE,
              dtype: torch.dtype = DTYPE) -> dict[str, float]:
    """Median host time in microseconds of a forward and of a forward+backward, launches stubbed:
    the calling thread's CPU time (`time.thread_time`), which on an idle machine is the wall
    time and on a busy one leaves out the time other processes held the core."""
    inputs = make_inputs(case, shape, dtype)
    with record_launches(cuda_like=True, keep_args=False) as launches:
        do = torch.empty_like(_forward(inputs))
        fns = {"forward": lambda: _forward(inputs), "fwd+bwd": lambda: _fwd_bwd(inputs, do)}
        return _median_times(fns, calls, launches.clear)


def compiled_host_time(case: str, calls: int = 200, shape: tuple[int, int, int, int] = SHAPE,
                       dtype: torch.dtype = DTYPE) -> dict:
    """`host_time`'s medians for the call compiled with torch.compile(fullgraph=True) (inductor;
    compiled before the clock starts), and "launches": the names of the Triton kernels one
    compiled forward+backward launches (the same as eager's: the custom ops run the same
    launchers)."""
    inputs = make_inputs(case, shape, dtype)
    compiled = torch.compile(_on_kernels, fullgraph=True)
    with record_launches(cuda_like=True, keep_args=False) as launches:
        do = torch.empty_like(compiled(**inputs))
        del launches[:]
        _fwd_bwd(inputs, do, compiled)
        names = [launch.name for launch in launches]
        fns = {"forward": lambda: compiled(**inputs), "fwd+bwd": lambda: _fwd_bwd(inputs, do, compiled)}
        return {**_median_times(fns, calls, launches.clear), "launches": names}


class _Floor(torch.autograd.Function):
    """A custom autograd op that allocates its output and input gradients and does nothing
    else: what any op with these inputs pays in torch alone (Function.apply, the autograd
    graph, the engine and `Tensor.backward`), whatever its own Python."""

    @staticmethod
    def forward(ctx, q, k, v, g):
        ctx.save_for_backward(q, k, v, g)
        return torch.empty_like(v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        return tuple(None if x is None else torch.empty_like(x) for x in ctx.saved_tensors)


def autograd_floor(case: str, calls: int = 200, shape: tuple[int, int, int, int] = SHAPE,
                   dtype: torch.dtype = DTYPE) -> dict[str, float]:
    """`host_time`'s medians for `_Floor` on `case`'s inputs: the part of linear_attention's
    host time that is torch's, not the library's."""
    inputs = make_inputs(case, shape, dtype)
    args = [inputs[name] for name in ("q", "k", "v", "log_decay")]

    def forward():
        return _Floor.apply(*args)

    def fwd_bwd(do):
        for x in args:
            if x is not None:
                x.grad = None
        forward().backward(do)

    do = torch.empty_like(forward())
    return _median_times({"forward": forward, "fwd+bwd": lambda: fwd_bwd(do)}, calls)


def _median_times(fns: dict[str, Callable[[], object]], calls: int, after: Callable[[], None] | None = None,
                  warmup: int = 5) -> dict:
    """{name: median thread time in microseconds of fn()} after `warmup` calls, on one thread;
    `after` (if any) runs after every call, off the clock (dropping the recorded launches; on
    a GPU, a synchronisation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host path is one thread; idle OpenMP workers only add noise
    result = {}
    try:
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(calls):
                t0 = time.thread_time()
                fn()
                times.append(time.thread_time() - t0)
                if after is not None:
                    after()
            result[name] = statistics.median(times) * 1e6
    finally:
        torch.set_num_threads(threads)
    return result


def stub_time(launches: list[Launch], calls: int = 200) -> float:
    """Microseconds that stubbed launches of `launches` cost by themselves: each replayed
    (`kernel[grid](...)` with as many positional arguments and the same keywords) under
    `record_launches`, the median over `calls` rounds of all of them. That much of
    `host_time` is the stub's own recording (on a GPU, Triton's launch costs instead)."""
    def replay():
        for launch in launches:
            launch.fn[launch.grid](*args[launch.name], **launch.kwargs)

    args = {x.name: (None,) * sum(p not in x.kwargs for p in x.fn.arg_names) for x in launches}
    with record_launches(cuda_like=True, keep_args=False) as recorded:
        return _median_times({"stub": replay}, calls, recorded.clear)["stub"]


class _NoOpKernel:
    """Stands in for a compiled kernel in Triton's cache: what `JITFunction.run` reads of one,
    and a launch that does nothing."""

    function = 0
    packed_metadata = ()

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


class _EveryKey(dict):
    """A kernel cache that holds the no-op kernel under every key: nothing compiles."""

    _kernel = _NoOpKernel()

    def get(self, key, default=None):
        return self._kernel


class _StandInDriver:
    """The driver queries `JITFunction.run` and its binder make: device 0, stream 0, sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def triton_run_time(launches: list[Launch], calls: int = 200) -> float | None:
    """Microseconds of Triton's own Python for `launches` (recorded with their arguments,
    keep_args=True), the median over `calls` rounds: each replayed through the real
    `JITFunction.run` -- binding and specialising every argument (a pointer's alignment, an
    int's divisibility), the cache key from them and the constexprs, the check of the
    kernel's globals, the grid -- with a stand-in driver, and a kernel cache that hands back a
    no-op kernel, so nothing compiles or launches. What a GPU machine adds to it is the C
    launcher (the arguments unpacked, every tensor's data_ptr() asked) and the driver's
    launch call. None if this Triton's `run` does not take the stand-ins (its internals
    change between releases; 3.6.0 and 3.7.1 do)."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.driver import driver

        saved_driver, saved_caches = driver._active, {}
    except (ImportError, AttributeError):
        return None
    try:
        driver.set_active(_StandInDriver())
        for x in launches:
            if id(x.fn) not in saved_caches:
                saved_caches[id(x.fn)] = (x.fn, x.fn.device_caches.get(0))
                _, key_cache, target, backend, binder = x.fn.create_binder()
                x.fn.device_caches[0] = (_EveryKey(), key_cache, target, backend, binder)

        def replay():
            for x in launches:
                JITFunction.run(x.fn, *x.args, grid=x.grid, warmup=False, **x.kwargs)

        return _median_times({"run": replay}, calls)["run"]
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    finally:
        driver._active = saved_driver
        for fn, cache in saved_caches.values():
            if cache is None:
                del fn.device_caches[0]
            else:
                fn.device_caches[0] = cache


def triton_time(case: str, calls: int = 200, shape: tuple[int, int, int, int] = SHAPE,
                dtype: torch.dtype = DTYPE) -> dict[str, float | None]:
    """`triton_run_time` of the launches of a forward and of a forward+backward of `case`."""
    inputs = make_inputs(case, shape, dtype)
    with record_launches(cuda_like=True, keep_args=True) as launches:
        o = _forward(inputs)
        forward = list(launches)
        o.backward(torch.empty_like(o))
        everything = list(launches)
    return {"forward": triton_run_time(forward, calls), "fwd+bwd": triton_run_time(everything, calls)}


def _describe(launch: Launch) -> str:
    return f"{launch.name}{list(launch.grid)}"


def report(shape: tuple[int, int, int, int] = SHAPE, calls: int = 200) -> dict:
    """Count and time every case; print a table; return the numbers."""
    B, H, T, D = shape
    print(f"linear_attention, B={B} H={H} T={T} D={D} {str(DTYPE).removeprefix('torch.')}, "
          f"launches stubbed (132 SMs, sm_90), median of {calls} calls")
    results = {}
    for case in CASES:
        counted, timed = count(case, shape), host_time(case, calls, shape)
        floor = autograd_floor(case, calls, shape)
        stub = stub_time(counted["forward"], calls), stub_time(counted["forward"] + counted["backward"], calls)
        compiled = compiled_host_time(case, calls, shape)
        triton = triton_time(case, calls, shape)
        fwd, bwd = counted["forward"], counted["backward"]
        row = {
            "floor_us_forward": round(floor["forward"], 1), "floor_us_fwd_bwd": round(floor["fwd+bwd"], 1),
            "stub_us_forward": round(stub[0], 1), "stub_us_fwd_bwd": round(stub[1], 1),
            "forward_launches": [_describe(x) for x in fwd], "backward_launches": [_describe(x) for x in bwd],
            "forward_torch_ops": counted["forward_torch"], "backward_torch_ops": counted["backward_torch"],
            "host_us_forward": round(timed["forward"], 1), "host_us_fwd_bwd": round(timed["fwd+bwd"], 1),
            "compiled_us_forward": round(compiled["forward"], 1),
            "compiled_us_fwd_bwd": round(compiled["fwd+bwd"], 1),
            **{f"triton_us_{part}": None if triton[key] is None else round(triton[key], 1)
               for part, key in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))},
        }
        results[case] = row
        n_fwd = len(fwd) + len(counted["forward_torch"])
        n_all = n_fwd + len(bwd) + len(counted["backward_torch"])
        print(f"\n{case}: {n_fwd} kernels forward, {n_all} forward+backward; host "
              f"{timed['forward']:.0f} us forward, {timed['fwd+bwd']:.0f} us forward+backward "
              f"(torch's floor for an op with these inputs: {floor['forward']:.0f} / {floor['fwd+bwd']:.0f} us; "
              f"the recording stub's own launches: {stub[0]:.0f} / {stub[1]:.0f} us)")
        if triton["fwd+bwd"] is not None:
            total = timed["fwd+bwd"] - stub[1] + triton["fwd+bwd"]
            print(f"  Triton's own launch path (JITFunction.run, a stand-in driver): {triton['forward']:.0f} / "
                  f"{triton['fwd+bwd']:.0f} us; with it in place of the stub's, about {total:.0f} us of host time "
                  "a forward+backward on this CPU, before the C launcher's and the driver's share")
        print("  forward   " + ", ".join(row["forward_launches"] + row["forward_torch_ops"]))
        print("  backward  " + ", ".join(row["backward_launches"] + row["backward_torch_ops"]))
        same = compiled["launches"] == [x.name for x in fwd + bwd]
        print(f"  compiled  (torch.compile, fullgraph) {compiled['forward']:.0f} us forward, "
              f"{compiled['fwd+bwd']:.0f} us forward+backward: "
              f"{compiled['fwd+bwd'] / timed['fwd+bwd']:.2f}x eager's host time, "
              + ("the same Triton launches" if same else f"launches {compiled['launches']}"))
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=SHAPE, metavar=("B", "H", "T", "D"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be a positive int, got {args.calls}")
    if not cache_cpu_allocations():
        print("(could not switch glibc to cached allocations: the times include fresh pages per buffer)")
    results = report(tuple(args.shape), args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(args.shape), "dtype": str(DTYPE), "calls": args.calls, "cases": results}, f,
                      indent=1)
    return results


if __name__ == "__main__":
    main()
