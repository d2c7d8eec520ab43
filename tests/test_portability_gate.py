"""The portability gate: nbval's kernels run under another numeric environment.

Saved outputs are made by `make execute` in the machine's default environment; `make test`
checks them with one thread, ATen's scalar code path and MKL's "compatible" matmul path
(conftest.PORTABILITY_ENV). These tests check that the gate is wired into nbval's kernel
start-up and that it really changes torch's round-off on this machine, so that a notebook
printing raw round-off fails here and not only on a reader's other CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture
def conftest(pytestconfig):
    """The repository's top-level conftest.py, as pytest loaded it (`import conftest` would
    give tests/conftest.py, which holds the shared test inputs)."""
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == ROOT_CONFTEST:
            return plugin
    raise LookupError(f"pytest did not load {ROOT_CONFTEST}")

PROBE = r"""
import hashlib, json, torch
g = torch.Generator().manual_seed(0)
a = torch.randn(512, 1024, generator=g, dtype=torch.float64)
b = torch.randn(1024, 512, generator=g, dtype=torch.float64)
x = torch.randn(16, 64, 300, generator=g, dtype=torch.float64)
ops = {
    "matmul": a @ b,
    "bmm": x @ x.transpose(-1, -2),
    "sum": a.sum(),
    "softmax": torch.softmax(x.float(), dim=-1),
}
print(json.dumps({k: hashlib.sha1(v.numpy().tobytes()).hexdigest() for k, v in ops.items()}))
"""


def _probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_kernels_start_in_the_gate_environment(conftest):
    seen = {}

    def fake_start(*args, **kwargs):
        seen.update(kwargs)
        return "km", "kc"

    start = conftest._start_kernel_in_gate_env(fake_start)
    assert start(kernel_name="python3", env={"EXTRA": "1"}) == ("km", "kc")
    for key, value in conftest.PORTABILITY_ENV.items():
        assert seen["env"][key] == value
    assert seen["env"]["EXTRA"] == "1" and seen["env"]["PYTHONHASHSEED"] == "0"


def test_nbval_uses_the_wrapped_start(pytestconfig, conftest):
    if not getattr(pytestconfig.option, "nbval", False):
        pytest.skip("the gate is installed when pytest runs with --nbval")
    import nbval.kernel

    if not conftest.portability_gate_on():
        pytest.skip("LINATTN_PORTABILITY_GATE=0")
    assert nbval.kernel.start_new_kernel.__name__ == "start"
    assert nbval.kernel.start_new_kernel.__qualname__.startswith("_start_kernel_in_gate_env")


def test_the_gate_changes_round_off_here(conftest):
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no vector path beyond ATen's default: nothing to vary")
    base = {k: v for k, v in os.environ.items() if k not in conftest.PORTABILITY_ENV}
    default, gated = _probe(base), _probe({**base, **conftest.PORTABILITY_ENV})
    changed = sorted(k for k in default if default[k] != gated[k])
    # measured on the development machines (AMD EPYC, Intel Xeon): matmul changes with
    # MKL_CBWR, bmm and softmax with ATEN_CPU_CAPABILITY, the full sum with the thread count
    assert len(changed) >= 2, f"the gate changed only {changed} of {sorted(default)}"
