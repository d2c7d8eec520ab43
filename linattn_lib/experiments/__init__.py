"""Every `python -m` command behind the book's measured claims:

* `python -m linattn_lib.experiments.mqar`        multi-query associative recall (chapter 7)
* `python -m linattn_lib.experiments.crossover`   softmax-vs-linear wall-time crossover (chapter 7)
* `python -m linattn_lib.experiments.charlm`      character-level language models (chapter 8)
* `python -m linattn_lib.experiments.complexity`  time and memory exponents, speed table (chapter 8)
* `python -m linattn_lib.experiments.bench`       benchmark sweep and targets (`make bench`)
* `python -m linattn_lib.experiments.gpu_check`   kernel self-test and timings on a GPU (`make gpu-check`)

Full runs write JSON results (command, config, hardware, library version, seeds) into
book/results/, which the notebooks read through `linattn_lib.results.load_result` (the
results also ship inside the package); the notebooks themselves run small live versions.
Nothing outside this folder imports it.
"""
