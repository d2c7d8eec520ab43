"""Launch configurations of every kernel, the rule that picks one, and where a kernel runs.

The kernels of the two-phase engine (forward and backward) and the delta rule's parallel kernels
walk both head dimensions in blocks; the others hold one whole in a program (padded to a power
of two) and tile the other. Head dims are
rounded up to one of a few buckets so that the set of configs a launcher can pick stays small
and finite: `CONFIGS` lists all of them, and
tests/test_kernels_compile.py compiles each one for every GPU target ahead of time and checks
that it fits that target's shared memory. `select_config` is the only way a launcher picks
a config, and its answers always come from `CONFIGS`.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

# where a kernel runs: re-exported, the launchers import them from here
from .devices import Capability, device_capability, interpreter_check, multiprocessor_count  # noqa: F401

# Head dims above this need a different tiling (the "whole" dim would not fit registers).
MAX_HEAD_DIM = 256
# The buckets a whole head dim is padded to. tl.dot needs every dimension >= 16; 64 is the
# smallest bucket because padding 16 to 64 costs little and keeps the config table short.
WHOLE_DIMS = (64, 128, 256)

# GPU targets the configs are compiled for ahead of time (tests/test_kernels_compile.py), with
# the most shared memory one block may use there (the opt-in maximum, in bytes).
TARGETS = {"sm_75": (7, 5), "sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
SMEM_LIMITS = {"sm_75": 64 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
# Turing (sm_75, the Colab T4) has no bfloat16 tensor cores.
TARGET_DTYPES = {name: ("fp16", "fp32") if cap < (8, 0) else ("bf16", "fp16", "fp32") for name, cap in TARGETS.items()}

# kernel name -> (name of the whole dim, name of the tiled dim) in that kernel's constexprs
DIM_NAMES = {
    "chunk_fwd": ("BK", "BV"),        # Dk whole (q . k), Dv tiled (the value columns)
    "noncausal_state": ("BK", "BV"),  # Dk whole, Dv tiled
    "noncausal_output": ("BA", "BC"),  # input dim whole, output dim tiled
    "decode": ("BK", "BV"),           # Dk whole, Dv tiled (looped inside one program)
    "favor": ("BD", "BM"),            # input dim whole, random features tiled (looped)
    # the two-phase forward tiles both head dims: blocks of BK, whatever the head dim
    "chunk_state": ("BK", "BV"),      # one Dk block per program, Dv tiled
    "chunk_state_wide": ("BK", "BV"),  # chunk_state with wider value tiles, for many programs (`state_config`)
    "chunk_state_few": ("BK", "BV"),  # chunk_state on 8 warps, for launches of few programs (`state_config`)
    "chunk_state_few_wide": ("BK", "BV"),  # chunk_state_wide's tiles on 8 warps, likewise
    "chunk_state_merge": ("BK", "BV"),  # split-T's merge: chunk_state's tiles (it gets its config)
    "chunk_decay": ("BK", "BV"),      # chunk_state's decays: one chunk per program (BK, BV unused)
    "chunk_output": ("BK", "BV"),     # Dk looped in blocks of BK, Dv tiled
    "chunk_dqk": ("BK", "BV"),        # two-phase backward: Dk tiled, Dv looped in blocks of BV
    "chunk_dv": ("BK", "BV"),         # Dv tiled, Dk looped in blocks of BK
    "chunk_bwd_prep": ("BV", "BK"),   # BT rows per program, Dv whole (BK unused)
    "live_length": ("BV", "BK"),      # chunk_bwd_prep's blocks of dO, read from the end (its config)
    "decay_grad": ("BK", "BV"),       # the log-decay's gradient: blocks of BT tokens (BK, BV unused)
    # the delta rule: the two state kernels hold Dk whole (BK) and multiply in blocks of BKW;
    # the parallel ones walk Dk in blocks of BK; all tile the values by BV
    **{name: ("BK", "BV") for name in ("delta_wy", "delta_state", "delta_output", "delta_bwd_state",
                                       "delta_bwd_dqk", "delta_bwd_wy")},
}

# Configs: kernel -> class -> {whole dim: (BT, tile, num_warps)}. The classes:
#   "mma16"  fp16 / bf16 on sm_80 to sm_89: every tl.dot on tensor cores, loads double-buffered
#   "sm90"   fp16 / bf16 on sm_90 (Hopper): mma16's configs but wider blocks in the parallel
#            kernels (chunk_output, chunk_dqk, chunk_dv), the wide state walks and chunk_fwd
#   "fp32"   float32 on sm_80+: tl.dot in true fp32 (FMA loops, no tensor cores), one stage
#   "sm75"   every dtype on sm_75 (the T4): 64 KiB of shared memory, tl.dot lowered to FMAs
# Chosen without a GPU, from an ahead-of-time sweep (BT in {16, 32, 64}, tiles {16, 32, 64},
# 4 or 8 warps, compiled for sm_75/80/86/90 with `kernel_anatomy.compile_report`): the config
# with the fewest register-spill instructions (STL/LDL in the SASS) on that class's targets,
# then the larger tile (fewer re-reads of the whole dim), then the longer chunk. Spills matter
# because the chunk kernels loop over the sequence: a spill in the loop body is local-memory
# traffic on every chunk. The first table (64-token chunks, 64- or 32-column tiles) spilled
# 500 to 1,900 instructions per chunk kernel at every head dim; in bf16 these spill (next to) nothing at head dims 64 and
# 128 on sm_80/sm_90 (the chunk kernels still spill some at 256). Registers are not the whole
# story -- smaller tiles re-read q and k more often, smaller chunks mean more, smaller
# matmuls -- so `python -m linattn_lib.experiments.gpu_check` times every candidate on a real GPU
# (`run_config_sweep`); its numbers should replace this evidence.
_TABLE: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {
    "chunk_fwd": {
        # The former 64: (32, 32, 8) and 128: (32, 16, 8) spilled on sm_90 under Triton 3.6.0 (4
        # and 14 STL/LDL, bf16), on sm_80-89 under 3.6.0 and 3.8.0 (4-38). 16 x 32 on 8 warps
        # spills none on sm_90 under 3.6.0, 3.7.1 or 3.8.0, aligned or not (D = 64: 178 / 208
        # registers aligned, 3.7.1 / 3.6.0; D = 128: 226 / 242) and issues fewer SASS instructions
        # per output (1,056 at D = 64 against 1,384-1,424 for 32 x 16); on sm_80-89 it spills at
        # D = 128 under 3.6.0 (16-23), where 16 x 16 spills none under any of the three.
        "mma16": {64: (16, 32, 8), 128: (16, 16, 8), 256: (32, 16, 8)},
        "sm90": {64: (16, 32, 8), 128: (16, 32, 8), 256: (32, 16, 8)},
        "fp32": {64: (16, 32, 8), 128: (16, 16, 8), 256: (16, 16, 8)},
        "sm75": {64: (16, 32, 8), 128: (16, 16, 8), 256: (16, 16, 8)},
    },
    "noncausal_state": {
        # 128: (64, 64, 8) spilled 2 STL/LDL on sm_80 (the gates); fp32 64: (32, 64, 4), 128: (32, 64, 8) 44, 52 (3.8.0)
        "mma16": {64: (64, 64, 4), 128: (32, 64, 8), 256: (32, 32, 8)},
        "fp32": {64: (32, 64, 8), 128: (32, 32, 8), 256: (32, 32, 8)},
        "sm75": {64: (32, 64, 8), 128: (32, 32, 8), 256: (16, 16, 8)},
    },
    "noncausal_output": {
        # fp32 128: (32, 64, 8) spilled 118 STL/LDL on sm_90 under Triton 3.6.0 (72 registers, none
        # under 3.7.1), fp16 on sm_75 133; (16, 32, 8), 256's config, spills none under 3.6-3.8
        "mma16": {64: (64, 64, 8), 128: (64, 64, 8), 256: (64, 32, 8)},
        "fp32": {64: (32, 64, 8), 128: (16, 32, 8), 256: (16, 32, 8)},
        "sm75": {64: (32, 64, 8), 128: (16, 32, 8), 256: (16, 32, 8)},
    },
    "decode": {  # one token: BT is unused; the state streams through in tiles of BV columns
        "mma16": {64: (64, 64, 4), 128: (64, 64, 8), 256: (64, 32, 8)},
        "fp32": {64: (32, 64, 4), 128: (32, 64, 8), 256: (32, 32, 8)},
        "sm75": {64: (32, 64, 4), 128: (32, 64, 8), 256: (32, 32, 8)},
    },
    "chunk_bwd_prep": {  # BT rows of dO and o per program, the whole Dv (memory-bound: small
        # blocks; 64 x 64 spilled 24-62 instructions on sm_80/sm_90)
        "mma16": {64: (32, 16, 4), 128: (16, 16, 4), 256: (8, 16, 4)},
        "fp32": {64: (32, 16, 4), 128: (16, 16, 4), 256: (8, 16, 4)},
        "sm75": {64: (32, 16, 4), 128: (16, 16, 4), 256: (8, 16, 4)},
    },
    "favor": {
        "mma16": {64: (64, 64, 4), 128: (64, 64, 8), 256: (64, 32, 8)},
        "fp32": {64: (32, 32, 8), 128: (16, 16, 8), 256: (16, 16, 8)},
        "sm75": {64: (32, 32, 8), 128: (16, 16, 8), 256: (16, 16, 8)},
    },
}
NUM_STAGES = {"mma16": 2, "sm90": 2, "fp32": 1, "sm75": 1}

# The two-phase forward (chunk_state.py, chunk_output.py): class -> (BT, BK, BV, num_warps),
# the same at every head dim (both dims are walked in blocks), so one config per class. The
# two kernels must share BT: the output kernel reads the states at the state kernel's chunk
# boundaries. Chosen without a GPU from an ahead-of-time sweep (BT 32/64, blocks 16-128, 4 or
# 8 warps, 2 or 3 stages; sm_75/80/90), compiled both as the compile test does and with the
# divisibility the JIT sees at the benchmark shape: no spills in either, then occupancy.
#   mma16: 64-token chunks (an fp32 entry state per chunk: 32-token chunks would double that
#   traffic). State 32 x 32 tiles: 4 * 4 * B * H programs walk the sequence (256 at
#   B * H = 16, where 64 x 64 tiles give 64 programs for 132 SMs); 128-168 registers, 3-4
#   CTAs per SM. Output: 16-wide Dk blocks, 32 value columns, 4 warps. It must pass the gates
#   of tests/test_kernels_compile.py (bf16, D = 64 and 128, sm_80 and sm_90: no spills, >= 2
#   CTAs per SM, pipelined loads): 163 registers on sm_80 / 128 on sm_90 as the JIT compiles
#   it there (3 / 4 CTAs per SM), 222 / 187 with no divisibility known (odd head dims: still
#   2 CTAs), 16-20 KiB of shared memory, no spills in either. The scores are recomputed per
#   value tile, so the widest BV that passes wins; BV = 64 does not: on 4 warps it passes the
#   gates (214-216 registers on sm_80) but spills 42-70 STL/LDL on sm_80 without divisibility
#   (over the compile test's budget of 32), on 8 warps it needs 160-192 registers (1 CTA).
#   The previous (64, 32, 64, 8) had 162-227 registers on sm_80: 1 CTA per SM.
#   Backward (chunk_grad.py), 64-token chunks like the state kernel whose states they read;
#   three 64 x 64 fp32 matrices (dO v^T, the decays, W) live at once, so 8 warps would need
#   <= 128 registers for 2 CTAs and none gets there (152-255 on sm_80). At 4 warps every
#   config fits 2 CTAs by registers; the sm_80 sweep (bf16, D = 128, no divisibility): dqk
#   16 x 16 blocks 214 registers, no spills (16 x 32: 255, 32 x 32: 96 spill instructions);
#   dv 32 x 64: 254, no spills (64-wide Dk blocks spill 117-365). As the JIT compiles them at
#   D = 64 / 128 (aligned) all their loop loads are async copies, 128-167 registers, 3-4 CTAs.
#   sm75 dqk: 32 x 32 x 32 spilled 35 instructions in fp16; 32 x 16 (Dk x Dv blocks) none.
#   fp32 / sm75: tl.dot is FMAs (or no tf32): 32-token chunks and 32 x 32 tiles, no spills.
#   sm90: Hopper (H100 / H200, the benchmark GPUs) has the registers for wider blocks in the
#   two parallel kernels that recompute a BT x BT matrix per block (the scores, or dO v^T and
#   the decays): with fewer blocks per chunk that work is done fewer times. sm_90, bf16,
#   D = 128, as the JIT compiles it: dqk 64 x 32 blocks on 8 warps 128 registers, 2 CTAs, 1,680
#   SASS instructions for 2 blocks per chunk (16 x 16 on 4 warps: 1,712 for each of 8 blocks);
#   output 32 x 64 on 8 warps 97 registers, 2 CTAs, 1,312 for 2 value tiles per chunk (16 x 32:
#   1,616 for each of 4). Without divisibility both take 175-230 registers (1 CTA), no spills.
#   dqk since it stopped transposing W (dk = q^T W stored transposed, fla #640: chunk_grad.py),
#   measured with the compile test's jobs (bf16, sm_90, D = 128; Triton 3.7.1 / 3.6.0): as the
#   JIT compiles it at head dims that are multiples of 16, 122 / 126 registers (2 CTAs, 2-6
#   registers below the 128 of the cliff; 1,696 / 1,704 SASS instructions); the sequence
#   length's divisibility (T, NT, n_rows) changes nothing. At head dims that are not multiples
#   of 16 (pointers aligned or not) 255 / 255 registers, no spills, 1 CTA per SM and 3,256 /
#   3,304 instructions: the unvectorised loads cost twice the instructions, so the second CTA
#   would not hide them either. Accepted: such head dims are rare, the launcher could pad them
#   (as the delta rule's do), and there the kernel still runs without spilling. If a Triton
#   release puts the aligned variant over 128, tests/test_kernels_compile.py's gate
#   (`test_gate_parallel_kernels_fit_two_ctas_per_sm`) fails: 64 x 32 blocks (140 registers
#   aligned) do not fit 8 warps either, so the way back is 4 warps.
#   The same blocks on sm_80 spill 56-86 instructions even aligned: Ampere keeps mma16.
#   chunk_state_wide (sm90): 32 x 64 state tiles, for launches of many programs
#   (`chunk_state.state_config`). At B * H = 64 (H200, D = 128, bf16, per-token decay) the
#   32 x 32 tiles give 1,024 programs of 70 registers: 7 CTAs per SM, so 2 waves, each warp
#   sharing its scheduler with 6 others (173 instructions per chunk, ~355 us of issue against
#   225 us of HBM); 32 x 64 tiles give 512 programs of 96 registers, 5 CTAs, one wave of at
#   most 4 per SM (233 per chunk: 137 us, HBM-bound). At B * H = 16 the 256 narrow programs
#   of 4 warps leave the schedulers idle: the two configs below.
#   chunk_state_few (mma16, sm90): the narrow tiles on 8 warps, for launches of 1 to 2
#   programs per SM (B * H = 16 at D = 128 on 132 SMs without z: 256 programs; with z's
#   column 320, narrow). There each scheduler has 2 warps and a warp issues at most one
#   instruction per ~4 cycles: the walk is bound by its chain, and 8 warps split the tile's
#   loads, decays and stores between twice as many warps (the loop's one tl.dot spreads
#   over warps [2, 4]). sm_90, bf16, D = 128, per-token decay, SASS per chunk (4 -> 8
#   warps): forward 173 -> 112, reversed 186 -> 115; 40 registers. Folding z into the
#   programs of value tile 0 (a product with ones) would give 256 programs when normalised
#   too, but a second tl.dot in the loop makes Triton put all 8 warps along M = 32 (six
#   repeat the rows of two), and in a branch of its own the key tile is no longer pipelined.
#   chunk_state_few_wide (sm90): chunk_state_wide's 32 x 64 tiles on 8 warps, for the
#   normalised pass at B * H = 16 (4 x 3 x 16 = 192 programs with z's column, where the
#   narrow tiles give 320): SASS per chunk, no decay, 148 -> 125 forward, 169 -> 134
#   reversed; per-head decay 184 -> 156, 224 -> 177.
#   decay_grad: one program per (sequence, head) walks its tokens from the end in blocks of BT
#   (BK, BV unused): 4096-token blocks on 8 warps, 4 steps of ~500 SASS instructions at
#   T = 16384 (blocks of 1024 on 4 warps: 16 of 469, a chain the model puts at 20 us for the 16
#   rows of the benchmark, more than the four torch ops it replaces).
_TWO_PHASE: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "chunk_state": {"mma16": (64, 32, 32, 4), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "chunk_state_wide": {"mma16": (64, 32, 32, 4), "sm90": (64, 32, 64, 4), "fp32": (32, 32, 32, 4),
                         "sm75": (32, 32, 32, 4)},
    "chunk_state_few": {"mma16": (64, 32, 32, 8), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "chunk_state_few_wide": {"mma16": (64, 32, 32, 8), "sm90": (64, 32, 64, 8), "fp32": (32, 32, 32, 4),
                             "sm75": (32, 32, 32, 4)},
    "chunk_state_merge": {"mma16": (64, 32, 32, 4), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "chunk_decay": {"mma16": (64, 32, 32, 1), "fp32": (32, 32, 32, 1), "sm75": (32, 32, 32, 1)},
    "decay_grad": {cls: (4096, 32, 32, 8) for cls in ("mma16", "fp32", "sm75")},
    "chunk_dqk": {"mma16": (64, 16, 16, 4), "sm90": (64, 64, 32, 8), "fp32": (32, 32, 32, 4),
                  "sm75": (32, 32, 16, 4)},
    "chunk_dv": {"mma16": (64, 32, 64, 4), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "chunk_output": {"mma16": (64, 16, 32, 4), "sm90": (64, 32, 64, 8), "fp32": (32, 32, 32, 4),
                     "sm75": (32, 32, 32, 4)},
}
for _kernel, _classes in _TWO_PHASE.items():
    _TABLE[_kernel] = {cls: dict.fromkeys(WHOLE_DIMS, entry) for cls, entry in _classes.items()}
# chunk_dv on sm_90 at Dk = Dv >= 128: one program per chunk, 64 x 128 blocks on 8 warps, so
# P^T = K Q^T is formed once per chunk, not once per value tile (fla's dv kernel does the same: it
# took 250 us on the H200 where ours, in two tiles, took 464). sm_90, D = 128, as the JIT
# compiles it (Triton 3.6.0 / 3.7.1): 96-128 registers, capped at 128 (MAXNREG) for 2 CTAs, no
# spills; 18-27% fewer warp instructions, by the fitted model (kernel_fit.py; its tiles went up to
# 64 columns) 7-21% faster. 4 warps (168-233 registers) spilled 300 where the JIT knows no
# divisibility. chunk_output likewise (fla's, one program of 128 x 128 blocks a chunk, took 224 us there unnormalised,
# ours in two tiles 388; 514 per-token): 64 x 128 blocks on 8 warps, the scores formed once a chunk; 118-128 registers
# capped (155-165 uncapped), no spills in bf16 (fp16 with a per-token decay: 2-4), 41-46% fewer warp instructions, by
# the fit 25-28% faster. The whole-op sweep times the two tiles of both.
_TABLE["chunk_dv"]["sm90"] = {**_TABLE["chunk_dv"]["mma16"], 128: (64, 64, 128, 8), 256: (64, 64, 128, 8)}
_TABLE["chunk_output"]["sm90"] = {**_TABLE["chunk_output"]["sm90"], 128: (64, 64, 128, 8), 256: (64, 64, 128, 8)}
_TABLE["live_length"] = _TABLE["chunk_bwd_prep"]  # the same blocks of dO, read from the end

# The delta rule (delta_rule.py): class -> (BT, BK, BV, num_warps), all kernels of one class
# sharing BT. BK: the Dk block of the loops; the two state kernels hold Dk whole (padded) and
# their BK is the Dk block of W S_n / K dS (0: whole, from registers: `_w_times_state`), the
# constexpr BKW of their config. BV: value columns per program (the Dv block of the loops of
# delta_wy / delta_bwd_wy / delta_bwd_dqk). Chosen without a GPU, from the ahead-of-time
# compile of the heaviest variants (per-token decay, initial and final state) as the JIT
# specialises them (tests/test_kernels_compile.py): no spill instructions, shared memory within
# every target of the class (mma16: sm_80's 163 KiB and sm_86 / sm_89's 99 KiB; sm75: 64 KiB).
#   delta_state: 64 x 128 W times a 128 x 32 S spilled 26 (bf16, sm_80) on 4 warps, none on 8;
#   fp32 with Dk = 128 whole in W S_n ~1,000, blocked by 32 none; at Dk = 256 a whole-Dk
#   W S_n spilled 62-186 (bf16): 64-blocks and 16 value columns.
#   delta_wy: 4 warps, no spills at head dims that are multiples of 16 (196-212 registers);
#   8 warps spilled 6 there on sm_80 (capped at 128 registers), none at other dims. delta_bwd_dqk
#   on 4 warps spilled 35 (bf16, sm_80, D = 64: 255 registers) under Triton 3.8.0, 8 none.
# The launchers pad head dims to multiples of 16 (`pad_head_dims`): with no divisibility known
# the state and backward kernels spilled 34-776 instructions on some targets.
#   sm75: the two parallel backward kernels spilled 56-66 (fp16, sm_75) on 4 warps, none on 8.
#   delta_bwd_state on sm_90, bf16, Dk = 64: 32 value columns spilled 22-118 with every BKW,
#   warp count and stage count tried; 16 columns on 8 warps in one stage none (224 registers).
_DELTA: dict[str, dict[str, tuple[int, ...]]] = {
    "delta_wy": {"mma16": (64, 64, 64, 4), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "delta_state": {"mma16": (64, 0, 32, 8), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "delta_output": {"mma16": (64, 32, 32, 4), "fp32": (32, 32, 32, 4), "sm75": (32, 32, 32, 4)},
    "delta_bwd_state": {"mma16": (64, 64, 32, 8), "fp32": (32, 32, 32, 8), "sm75": (32, 32, 32, 4)},
    "delta_bwd_dqk": {"mma16": (64, 16, 32, 8), "fp32": (32, 32, 32, 8), "sm75": (32, 32, 32, 8)},
    "delta_bwd_wy": {"mma16": (64, 16, 32, 8), "fp32": (32, 32, 32, 8), "sm75": (32, 32, 32, 8)},
}
# (kernel, class, whole Dk) -> (BT, BK, BV, num_warps, num_stages): the exceptions above
_DELTA_AT = {
    ("delta_state", "mma16", 256): (64, 64, 16, 8, 1), ("delta_state", "fp32", 256): (32, 32, 32, 8, 1),
    ("delta_bwd_state", "mma16", 256): (64, 64, 16, 8, 1), ("delta_bwd_state", "fp32", 256): (32, 32, 32, 8, 1),
    ("delta_bwd_state", "fp32", 64): (32, 32, 32, 4, 1),   # 8 warps spilled 8 on sm_90
    ("delta_bwd_state", "sm90", 64): (64, 64, 16, 8, 1),
}


def _delta_config(kernel: str, cls: str, whole: int) -> dict:
    """A delta-rule kernel's config: the state kernels get Dk whole as BK and their block BKW."""
    stages = NUM_STAGES[cls]
    base = "mma16" if cls == "sm90" else cls
    BT, BK, BV, num_warps = _DELTA[kernel][base]
    if (kernel, cls, whole) in _DELTA_AT or (kernel, base, whole) in _DELTA_AT:
        BT, BK, BV, num_warps, stages = _DELTA_AT.get((kernel, cls, whole)) or _DELTA_AT[(kernel, base, whole)]
    if kernel not in ("delta_state", "delta_bwd_state"):
        return {"BT": BT, "BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": stages}
    BKW = BK or whole
    if BKW < whole:  # S_n is read back after its store: no loads pipelined across it
        stages = 1
    return {"BT": BT, "BK": whole, "BKW": BKW, "BV": BV, "num_warps": num_warps, "num_stages": stages}
# Every other kernel (and the two-phase ones not listed) picks the same config on Hopper as on
# Ampere.
for _classes in _TABLE.values():
    _classes.setdefault("sm90", _classes["mma16"])


# (kernel, class) -> registers per thread the compiler may use (Triton's maxnreg), where the head
# dims are multiples of 16 (`max_registers`). chunk_dqk's sm_90 config fits two 8-warp CTAs per
# SM at 128, and the gated (heaviest) variant compiles to 118-122; but the variant without a
# decay or a normaliser came to 130-131, one CTA per SM, and on an H200 it took 1.17 ms where the
# normalised one took 0.76 (book/results/gpu/). Capped at 128 it compiles with no spill and the
# same instruction count (tests/test_perf_model.py). Other head dims compile without the
# divisibility the JIT sees at multiples of 16, to 175-230 registers: capped, they would spill.
# chunk_dv's and chunk_output's one-tile configs (8 warps, D >= 128): capped the same way. The cap
# applies to 8-warp configs only (4-warp ones fit two CTAs at 256).
MAXNREG = {("chunk_dqk", "sm90"): 128, ("chunk_dv", "sm90"): 128, ("chunk_output", "sm90"): 128}

# (kernel, class) whose fp32 operands of the in-chunk products are rounded to bf16 before the
# product, for bf16 inputs (`rounds_operands`; fla does it in all its kernels). On an H200 the
# parallel kernels' times follow the warp instructions they issue (~1.9 a cycle per SM,
# linattn_lib/experiments/kernel_fit.py: fitted on 38 measured launches, leave-one-out median
# error 9%): rounded, chunk_dqk issued 18-41% fewer and chunk_dv 19-34% fewer when adopted (sm_90,
# D = 128; 21-40% and 29-42% with the later cuts, kernel_fit.json), predicted 11-25% faster. chunk_output's products barely change (-1 to -3%): left as it was.
ROUNDED = {("chunk_dqk", "sm90"), ("chunk_dv", "sm90")}

# class -> num_stages of a plain state walk (`plain_walk` below: no decay, no key scales or z
# weights), whose two operands are both copied to shared memory asynchronously (no load in the
# loop goes through registers): 3 keeps two chunks in flight. The H200 timed every walk at 1.2-1.5
# us a chunk whatever its tiles and no faster at 3 or 4 stages than at 2 (1.9 at 1), its keys then
# read through registers one chunk ahead; fla's walk, both operands copied, at 0.73. Measured next
# GPU run (the GPU check's whole-op sweep times the walks at 2 and 4 stages too).
PLAIN_WALK_STAGES = {"sm90": 3}
_STATE_WALKS = ("chunk_state", "chunk_state_wide", "chunk_state_few", "chunk_state_few_wide")


def max_registers(cfg: dict, dk: int, dv: int) -> int | None:
    """The maxnreg to launch `cfg` with at head dims `dk`, `dv`: its cap when both are multiples
    of 16, else None (no cap)."""
    cap = cfg.get("maxnreg")
    return cap if cap is not None and dk % 16 == 0 and dv % 16 == 0 else None


def plain_walk(dtype: torch.dtype, decay: int, key_scale, z_weights,
               track_z: bool) -> bool:
    """Whether every load of a walk's loop feeds its product as it is read
    (chunk_state.py's `_keys_transposed`): no decay, no key scales and, with z, no weights and
    bf16 keys (z's fp16 product converts them)."""
    if decay or key_scale is not None:
        return False
    return not track_z or (z_weights is None and dtype == torch.bfloat16)


def walk_keys_t(cfg: dict, decay: int, key_scale) -> bool:
    """Whether a walk reads its keys transposed (`_keys_transposed`, copied ahead): without key
    scales, and with a decay only as the GPU check's candidate "decayed_keys_t" (then decayed in
    the product's operand layout, once per warp: 235 SASS a chunk at 3 stages, not 129; sm_90)."""
    return key_scale is None and (not decay or cfg.get("decayed_keys_t", False))


def walk_stages(cfg: dict, plain: bool, keys_t: bool = False) -> int:
    """The walk's pipelining depth: the config's "plain_stages" (`PLAIN_WALK_STAGES`) for a plain
    walk or one reading its keys transposed (`walk_keys_t`), else its num_stages."""
    return cfg.get("plain_stages", cfg["num_stages"]) if plain or keys_t else cfg["num_stages"]


def _config(kernel: str, cls: str, whole: int) -> dict:
    if kernel in _DELTA:
        return _delta_config(kernel, cls, whole)
    entry = _TABLE[kernel][cls][whole]
    w, t = DIM_NAMES[kernel]
    if len(entry) == 4:  # blocked in both dims (the two-phase forward)
        BT, block, tile, num_warps = entry
        cfg = {"BT": BT, w: block, t: tile, "num_warps": num_warps, "num_stages": NUM_STAGES[cls]}
    else:
        BT, tile, num_warps = entry
        cfg = {"BT": BT, w: whole, t: tile, "num_warps": num_warps, "num_stages": NUM_STAGES[cls]}
    if (kernel, cls) in MAXNREG and num_warps == 8:  # two 8-warp CTAs on an SM
        cfg["maxnreg"] = MAXNREG[kernel, cls]
    if (kernel, cls) in ROUNDED:
        cfg["round_operands"] = "bf16"
    if kernel in _STATE_WALKS and cls in PLAIN_WALK_STAGES:
        cfg["plain_stages"] = PLAIN_WALK_STAGES[cls]
    return cfg


def _configs(kernel: str) -> list[dict]:
    out: list[dict] = []
    for cls in NUM_STAGES:
        for whole in WHOLE_DIMS:
            cfg = _config(kernel, cls, whole)
            if cfg not in out:
                out.append(cfg)
    return out


# Every config a launcher can pick, per kernel.
CONFIGS: dict[str, list[dict]] = {name: _configs(name) for name in DIM_NAMES}


def whole_dim(d: int) -> int:
    """The bucket a head dim held whole in a program is padded to."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support head dims up to {MAX_HEAD_DIM}, got {d}")
    return next(b for b in WHOLE_DIMS if d <= b)


# Triton releases that miscompile a tl.dot of the transpose of another tl.dot's result on Hopper
# (fla-org/flash-linear-attention#640: wrong gradients at BK = 64; fixed in 3.7.1). The kernels
# that still hold the pattern (tests/test_kernels_dot_transpose.py finds them) refuse there:
# the delta rule's backward (A^T dO, ds^T Q, (A^-1)^T dU, ...; its `launch`). Rewriting them as
# chunk_grad.py's were (transposed products from the loaded tiles, transposed outputs through
# transposed pointers) would lift the refusal.
TRANSPOSED_DOT_BAD = ((3, 4, 0), (3, 7, 1))
TRANSPOSED_DOT_KERNELS = ("delta_bwd_state", "delta_bwd_dqk", "delta_bwd_wy")


@functools.cache
def triton_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the installed Triton ("3.6.0+git..." -> (3, 6, 0)), read once:
    `delta_rule_attention(backend="auto")` asks at every call that needs a gradient on Hopper."""
    import re

    import triton

    nums = [int(x) for x in re.findall(r"\d+", triton.__version__.split("+")[0])[:3]]
    return tuple(nums + [0] * (3 - len(nums)))


def miscompiles_transposed_dots(capability: Capability, version: tuple | None = None) -> bool:
    """Whether Triton `version` (default: the installed one) miscompiles a dot of a transposed
    dot result on a GPU of `capability` (None: CPU, the interpreter: never)."""
    if capability is None or tuple(capability)[0] != 9:
        return False
    lo, hi = TRANSPOSED_DOT_BAD
    return lo <= (version or triton_version()) < hi


def refuse_transposed_dots(what: str, device) -> None:
    """Raise where `what` (a kernel that feeds a dot with a transposed dot result) would be
    miscompiled: Hopper with Triton in [3.4, 3.7.1). A Python check, no synchronisation."""
    cap = device_capability(device)
    if miscompiles_transposed_dots(cap):
        import triton

        raise RuntimeError(
            f"{what}: Triton {triton.__version__} miscompiles this kernel on sm_{cap[0]}{cap[1]} (Hopper): a "
            "tl.dot of a transposed tl.dot result gives wrong gradients for Triton 3.4 <= v < 3.7.1 "
            "(flash-linear-attention issue #640). Install triton>=3.7.1, or use the torch backend.")


def select_config(kernel: str, d_whole: int, dtype: torch.dtype, device_or_capability=None) -> dict:
    """The launch config of `kernel` when the head dim it holds whole is `d_whole`.

    `device_or_capability` is a torch device or a (major, minor) pair; None and CPU devices
    (the interpreter) get the sm_80 (pre-Hopper) choice. The answer is always an entry of CONFIGS[kernel].
    """
    if kernel not in CONFIGS:
        raise KeyError(f"unknown kernel {kernel!r}; expected one of {sorted(CONFIGS)}")
    cap = device_or_capability
    if cap is not None and not isinstance(cap, tuple):
        cap = device_capability(cap)
    if cap is not None and tuple(cap) < (8, 0):
        cls = "sm75"
    elif dtype == torch.float32:
        cls = "fp32"
    elif cap is not None and tuple(cap) >= (9, 0):
        cls = "sm90"
    else:
        cls = "mma16"
    return _config(kernel, cls, whole_dim(d_whole))


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def selectable_configs(kernel: str, target: str, dtype: str) -> list[dict]:
    """Every config `select_config` can return for `kernel` on `target` ("sm_80") with inputs
    of `dtype` ("fp32", "fp16", "bf16"): what the compile test builds for that target."""
    out = []
    for d in range(1, MAX_HEAD_DIM + 1):
        cfg = select_config(kernel, d, _TORCH_DTYPES[dtype], TARGETS[target])
        if cfg not in out:
            out.append(cfg)
    return out


# experiments (gpu_extras): kernel name -> keys to change in its launch config, while `overridden`
OVERRIDES: dict[str, dict] = {}


@contextlib.contextmanager
def overridden(changes: dict[str, dict]) -> Iterator[None]:
    """Within the block, every launch of kernel `k` that a launcher configures through
    `launch_config` uses its config updated with `changes[k]`, e.g. {"chunk_dqk": {"maxnreg":
    128}} (a cap on registers per thread, passed to Triton) or {"chunk_output":
    {"round_operands": True}}: for timing the whole op under a change on a GPU. Not
    thread-safe; nested blocks replace, then restore."""
    saved = dict(OVERRIDES)
    OVERRIDES.clear()
    OVERRIDES.update(changes)
    try:
        yield
    finally:
        OVERRIDES.clear()
        OVERRIDES.update(saved)


def rounds_operands(cfg: dict, dtype) -> bool:
    """Whether a parallel kernel (chunk_output, chunk_dqk, chunk_dv) launched with `cfg` rounds the
    fp32 operands of its in-chunk products (scores, gradient weights, state tiles) to the 16-bit
    input dtype before the product, as fla does, instead of multiplying them in tf32.
    `cfg["round_operands"]`: "bf16" (the default of the kernels in `ROUNDED`) for bf16 inputs only,
    True for fp16 too (an experiment: fp16 can lose what falls below its range, the normalised
    backward's 1 / den factors; bf16 has fp32's range), False or absent: never."""
    flag = cfg.get("round_operands")
    if flag == "bf16":
        return dtype in (torch.bfloat16, "bf16")
    return bool(flag) and dtype in (torch.bfloat16, torch.float16, "bf16", "fp16")


def dot_precision(dtype) -> str:
    """input_precision of the kernels' tl.dot calls, for inputs of `dtype` (torch or "fp32").

    fp32 inputs get "ieee" (true fp32 products: fp32 in, fp32-accurate out). For 16-bit inputs
    the score and value products run on fp16/bf16 tensor cores whatever this says; the products
    with the fp32 state use "tf32" (fp32 range, 10-bit mantissa, like the inputs; sm_75 has no
    tf32 and computes them in full fp32).
    """
    return "ieee" if dtype in (torch.float32, "fp32") else "tf32"


def signature_of(fn, cfg: dict, dtype: str, flags: dict, input_ptrs: set) -> tuple[dict, dict]:
    """(signature, constexprs) for an ahead-of-time compile of `fn` with inputs of `dtype`: the
    config's tile sizes, `flags` for the other constexprs (DOT_PREC from the dtype), pointers
    named in `input_ptrs` in `dtype` and every other one fp32, every other argument i32."""
    flags = dict(flags, DOT_PREC=dot_precision(dtype))
    constexprs = {p.name: cfg.get(p.name, flags.get(p.name)) for p in fn.params if p.is_constexpr}
    signature = {n: "constexpr" if n in constexprs else "i32" if not n.endswith("_ptr")
                 else f"*{dtype}" if n in input_ptrs else "*fp32" for n in fn.arg_names}
    return signature, constexprs


# --------------------------------------------------------------------------------------
# where a kernel runs: compiled on CUDA, interpreted on CPU
# --------------------------------------------------------------------------------------

_TWINS: dict = {}


def _twin(fn):
    """The interpreted twin of a @triton.jit function's Python source (cached)."""
    from triton.runtime.interpreter import InterpretedFunction

    if fn not in _TWINS:
        _TWINS[fn] = InterpretedFunction(fn)
    return _TWINS[fn]


class _Interpreted:
    """A kernel launched through the Triton interpreter, whatever TRITON_INTERPRET said.

    `kernel[grid](...)` runs every program of the grid with numpy on CPU tensors. Triton's own
    library functions (tl.zeros, tl.sum, tl.cumsum, ...) are themselves @triton.jit functions;
    when the interpreter was not switched on before `import triton` they are compiled-kind
    functions that refuse to be called from Python, so for the duration of the launch a call
    to any of them runs its interpreted twin instead. The swap is undone afterwards, so the
    same process can still compile kernels for a GPU (the compile test does).
    """

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            original = JITFunction.__call__

            def device_call(fn, *a, **kw):  # a call of a @triton.jit helper inside a kernel
                twin = _twin(fn.fn)
                patch_lang = getattr(interpreter, "_patch_lang", None)
                if patch_lang is None or not hasattr(twin, "rewrite"):  # other Triton versions
                    return twin(*a, **kw)
                scope = patch_lang(fn.fn)  # what InterpretedFunction.__call__ does, but undone after
                try:
                    return twin.rewrite()(*a, **kw)
                finally:
                    if scope is not None:
                        scope.restore()

            JITFunction.__call__ = device_call
            try:
                return _twin(self.kernel.fn)[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = original

        return launch


def launchable(kernel, device):
    """The object to launch `kernel` with, `launchable(kernel, device)[grid](*args)`.

    CUDA tensors get the compiled JITFunction. CPU tensors get the Triton interpreter, which
    runs the same kernel source with numpy, one program after another (slow: for teaching and
    tests). This works whether or not TRITON_INTERPRET=1 was set before Triton was imported,
    and leaves the JITFunction itself untouched for ahead-of-time compilation.
    """
    if (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda" and (
            not isinstance(kernel, _interpreted_type())):  # (a tensor's .device is a torch.device)
        return kernel
    interpreter_check()  # this Triton and NumPy can run the interpreter (once)
    if isinstance(kernel, _interpreted_type()):  # TRITON_INTERPRET=1 at import: already one
        return kernel
    return _Interpreted(kernel)


@functools.cache
def _interpreted_type() -> type:
    """Triton's InterpretedFunction, imported on first use (an import statement in
    `launchable` cost about 1 us a launch on the CUDA path)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction
