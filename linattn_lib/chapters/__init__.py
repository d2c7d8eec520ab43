"""Helpers only the book's chapters use: plots, widgets, cost models, estimators, probes.

They build on `linattn_lib.core`; nothing in `core/` imports them.
"""
