"""Triton kernels for linattn_lib, installed and imported as `linattn_lib.kernels`.

One chunked engine for causal linear attention (forward, backward), a non-causal pair of
kernels, a decoding step and the fused FAVOR+ feature map. Each module holds its `@triton.jit` kernels and the launcher
that picks a config and starts them; nothing is launched at import time. The autograd
wrappers live in `linattn_lib/core/triton_ops.py`.

    chunk_decay.py   chunk_decay_kernel    every chunk's decays, in parallel, before the kernels
                                           that need them; chunk_decays
    chunk_state.py   chunk_state_kernel    causal forward, phase 1: every chunk's entry state;
                     chunk_state_merge_kernel  split-T: runs of chunks walked in parallel, merged
    chunk_output.py  chunk_output_kernel   phase 2: all chunks' outputs in parallel; chunk_fwd_two_phase
    chunk_grad.py    chunk_dqk_kernel, chunk_dv_kernel (chunk_dqkv_kernel: both in one)
                                           the two-phase backward (phase 1 is chunk_state reversed);
                                           chunk_bwd_two_phase
    chunk_grad_prep.py chunk_bwd_prep_kernel (live_length_kernel), decay_grad_kernel
                                           around it: 1 / den, dL/dden, live lengths from dO; the
                                           log-decay's gradient
    chunk_grad_specs.py                    the backward kernels' ahead-of-time compile specs
    sequences.py     where a program's tokens and states are: batched or packed (cu_seqlens)
    shapes.py        the launchers' shape checks (metadata only): a wrong shape is refused, not
                     read or written outside its tensor
    chunk_fwd.py     chunk_fwd_kernel      causal forward in one pass (the book's
                                           one-pass kernel; run backwards in time it gives dV)
    noncausal.py     noncausal_state_kernel, noncausal_output_kernel
    decode.py        decode_kernel         one token, state updated in place
    delta_rule.py    delta_wy_kernel, delta_state_kernel, delta_output_kernel and their backward
                                           the chunked delta rule (DeltaNet, Gated DeltaNet): the
                                           UT transform, the state walk, the outputs; delta_rule_fwd
    favor.py         favor_kernel          FAVOR+ positive features: projection, stabiliser, exp fused
    configs.py       CONFIGS (every config a launcher can pick), select_config, launchable
    devices.py       device_capability, multiprocessor_count: torch.cuda asked once per device

`KERNELS` maps each kernel name to its JITFunction and a `compile_spec(config, dtype)` that
gives the signature of its heaviest variant: tests/test_kernels_compile.py compiles, for every
GPU target in `TARGETS`, each config `select_config` can pick there (`selectable_configs`),
ahead of time and without a GPU, and checks it fits `SMEM_LIMITS`.
"""
from .chunk_decay import chunk_decay_kernel, chunk_decays
from .chunk_decay import compile_spec as _chunk_decay_spec
from .chunk_fwd import chunk_fwd, chunk_fwd_kernel
from .chunk_fwd import compile_spec as _chunk_fwd_spec
from .chunk_grad import (
    chunk_bwd_two_phase,
    chunk_dqk,
    chunk_dqk_kernel,
    chunk_dv,
    chunk_dv_kernel,
)
from .chunk_grad_prep import (
    chunk_bwd_prep,
    chunk_bwd_prep_kernel,
    decay_grad,
    decay_grad_kernel,
    live_length_kernel,
)
from .chunk_grad_specs import compile_spec_decay_grad as _decay_grad_spec
from .chunk_grad_specs import compile_spec_dqk as _chunk_dqk_spec
from .chunk_grad_specs import compile_spec_dv as _chunk_dv_spec
from .chunk_grad_specs import compile_spec_live_length as _live_length_spec
from .chunk_grad_specs import compile_spec_prep as _chunk_prep_spec
from .chunk_output import chunk_fwd_two_phase, chunk_output, chunk_output_kernel
from .chunk_output import compile_spec as _chunk_output_spec
from .chunk_state import chunk_state_kernel, chunk_state_merge_kernel, chunk_states, split_count
from .chunk_state import compile_spec as _chunk_state_spec
from .chunk_state import compile_spec_merge as _chunk_state_merge_spec
from .configs import (
    CONFIGS,
    DIM_NAMES,
    MAX_HEAD_DIM,
    SMEM_LIMITS,
    TARGET_DTYPES,
    TARGETS,
    WHOLE_DIMS,
    device_capability,
    dot_precision,
    launchable,
    overridden,
    rounds_operands,
    select_config,
    selectable_configs,
    whole_dim,
)
from .decode import compile_spec as _decode_spec
from .decode import decode_kernel, decode_step
from .delta_rule import DELTA_KERNELS, delta_rule_fwd
from .delta_rule import compile_spec as _delta_spec
from .favor import compile_spec as _favor_spec
from .favor import favor_features, favor_kernel
from .noncausal import compile_spec_output as _noncausal_output_spec
from .noncausal import compile_spec_state as _noncausal_state_spec
from .noncausal import (
    noncausal_output,
    noncausal_output_kernel,
    noncausal_state,
    noncausal_state_kernel,
)

# kernel name -> (the @triton.jit function, compile_spec(config, dtype) -> (signature, constexprs))
KERNELS = {
    "chunk_fwd": (chunk_fwd_kernel, _chunk_fwd_spec),
    "chunk_state": (chunk_state_kernel, _chunk_state_spec),
    "chunk_state_wide": (chunk_state_kernel, _chunk_state_spec),
    "chunk_state_few": (chunk_state_kernel, _chunk_state_spec),
    "chunk_state_few_wide": (chunk_state_kernel, _chunk_state_spec),
    "chunk_state_merge": (chunk_state_merge_kernel, _chunk_state_merge_spec),
    "chunk_decay": (chunk_decay_kernel, _chunk_decay_spec),
    "chunk_output": (chunk_output_kernel, _chunk_output_spec),
    "chunk_bwd_prep": (chunk_bwd_prep_kernel, _chunk_prep_spec),
    "live_length": (live_length_kernel, _live_length_spec),
    "chunk_dqk": (chunk_dqk_kernel, _chunk_dqk_spec),
    "chunk_dv": (chunk_dv_kernel, _chunk_dv_spec),
    "decay_grad": (decay_grad_kernel, _decay_grad_spec),
    "noncausal_state": (noncausal_state_kernel, _noncausal_state_spec),
    "noncausal_output": (noncausal_output_kernel, _noncausal_output_spec),
    "decode": (decode_kernel, _decode_spec),
    "favor": (favor_kernel, _favor_spec),
    **{name: (fn, _delta_spec(name)) for name, fn in DELTA_KERNELS.items()},
}

__all__ = [
    "CONFIGS",
    "DIM_NAMES",
    "KERNELS",
    "MAX_HEAD_DIM",
    "SMEM_LIMITS",
    "TARGETS",
    "TARGET_DTYPES",
    "WHOLE_DIMS",
    "chunk_bwd_prep",
    "chunk_bwd_two_phase",
    "chunk_decays",
    "chunk_dqk",
    "chunk_dv",
    "chunk_fwd",
    "chunk_fwd_two_phase",
    "chunk_output",
    "chunk_states",
    "decay_grad",
    "decode_step",
    "delta_rule_fwd",
    "device_capability",
    "dot_precision",
    "overridden",
    "rounds_operands",
    "favor_features",
    "launchable",
    "noncausal_output",
    "noncausal_state",
    "select_config",
    "selectable_configs",
    "split_count",
    "whole_dim",
]
