"""Experiments behind the book's measured claims, each a module with a CLI:

* `python -m linattn_lib.experiments.mqar`   multi-query associative recall (chapter 7)
* `python -m linattn_lib.experiments.charlm` character-level language models (chapter 8)
* `python -m linattn_lib.experiments.complexity` time and memory exponents, speed table (chapter 8)

Full runs write JSON results (command, config, hardware, library version, seeds) that the
notebooks plot; the notebooks themselves run small live versions.
"""
