"""Ahead-of-time compile signatures of the backward's kernels (kernels/chunk_grad.py): each
kernel's heaviest variant, as `KERNELS` hands them to tests/test_kernels_compile.py and the GPU
check's dry run. Kept apart from the kernels, which the book prints."""
from __future__ import annotations

from .configs import dot_precision, rounds_operands

# a decay per head's g, or a decay per token's tables (chunk_decays)
DECAY_TABLES = ["g_ptr", "hi_ptr", "lo_ptr", "ka_ptr", "kr_ptr"]


def compile_spec_prep(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_bwd_prep_kernel`."""
    signature = {"do_ptr": f"*{dtype}", "o_ptr": f"*{dtype}",
                 "den_ptr": "*fp32", "r_ptr": "*fp32", "e_ptr": "*fp32",
                 "len_ptr": "*i32", "T": "i32", "Dv": "i32"}
    constexprs = {"BT": cfg["BT"], "BV": cfg["BV"], "NORMALIZE": True,
                  "FIND_LEN": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs


def _spec(names: list[str], dtype: str, cfg: dict,
          ints: list[str]) -> tuple[dict, dict]:
    signature = {
        n: (f"*{dtype}" if n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr",
                                 "dq_ptr", "dk_ptr", "dv_ptr")
            else "*i32" if n in ("cu_ptr", "co_ptr", "ci_ptr", "len_ptr")
            else "*fp32")
        for n in names}
    signature.update(dict.fromkeys(ints, "i32"))
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2,
                  "NORMALIZE": True, "HAS_LEN": True, "IS_VARLEN": False,
                  "DOT_PREC": dot_precision(dtype),
                  "ROUND": rounds_operands(cfg, dtype), "EVEN_D": False}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs


def compile_spec_dqk(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_dqk_kernel`'s heaviest variant
    (decay, normaliser)."""
    names = ["q_ptr", "k_ptr", "v_ptr", "do_ptr", *DECAY_TABLES, "r_ptr", "e_ptr",
             "h_ptr", "hz_ptr", "dh_ptr", "dhz_ptr", "dq_ptr", "dk_ptr",
             "dg_ptr", "cu_ptr", "co_ptr", "ci_ptr", "len_ptr"]
    signature, constexprs = _spec(names, dtype, cfg,
                                  ["T", "H", "Dk", "Dv", "NT", "n_rows"])
    # bf16 inputs read bf16 entry states (chunk_bwd_two_phase)
    if dtype == "bf16":
        signature["h_ptr"] = "*bf16"
    signature["DG"], constexprs["DG"] = "constexpr", True
    # the default backward's variant (recomputed states): the one the gates
    # hold to their register budget
    signature["KEPT"], constexprs["KEPT"] = "constexpr", False
    return signature, constexprs


def compile_spec_dv(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_dv_kernel`'s heaviest variant
    (decay, normaliser)."""
    names = ["q_ptr", "k_ptr", "do_ptr", *DECAY_TABLES, "r_ptr", "dh_ptr",
             "dv_ptr",
             "cu_ptr", "co_ptr", "ci_ptr", "len_ptr"]
    return _spec(names, dtype, cfg, ["T", "H", "Dk", "Dv", "NT"])


def compile_spec_decay_grad(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `decay_grad_kernel` (fp32 whatever `dtype`;
    packed, with a final-state term)."""
    signature = {"part_ptr": "*fp32", "end_ptr": "*fp32", "dg_ptr": "*fp32",
                 "cu_ptr": "*i32", "T": "i32", "H": "i32", "n_rows": "i32",
                 "NK": "i32"}
    constexprs = {"BT": cfg["BT"], "HAS_END": True, "IS_VARLEN": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs


def compile_spec_live_length(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `live_length_kernel`."""
    signature = {"do_ptr": f"*{dtype}", "len_ptr": "*i32",
                 "T": "i32", "Dv": "i32", "P": "i32"}
    constexprs = {"BT": cfg["BT"], "BV": cfg["BV"]}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs
