"""Heavy experiments (training runs, long sweeps) with a command-line interface.

The book runs small live versions and plots the committed full results.
"""
