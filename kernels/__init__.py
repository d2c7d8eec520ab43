"""Triton kernels for linattn_lib, installed as `linattn_lib.kernels`."""
