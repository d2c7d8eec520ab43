"""Every `python -m` command behind the book's measured claims:

* `python -m linattn_lib.experiments.mqar`        multi-query associative recall (chapter 7)
* `python -m linattn_lib.experiments.crossover`   softmax-vs-linear wall-time crossover (chapter 7)
* `python -m linattn_lib.experiments.charlm`      character-level language models (chapter 8)
* `python -m linattn_lib.experiments.complexity`  time and memory exponents, speed table (chapter 8)
* `python -m linattn_lib.experiments.bench`       benchmark sweep and targets (`make bench`)
* `python -m linattn_lib.experiments.gpu_check`   the GPU check: timings, profile, self-test (`make gpu-check`;
                                                  `--dry-run` compiles its launches for sm_90 on a CPU)
* `python -m linattn_lib.experiments.host_overhead`  launches per call and the host time, eager and compiled
* `python -m linattn_lib.experiments.perf_predictions`  the performance model's predictions and its
                                                  calibration on published H100 times (appendix A)

Full runs write JSON results (command, config, hardware, library version, seeds) into
book/results/, which the notebooks read through `linattn_lib.results.load_result` (the
results also ship inside the package); the notebooks themselves run small live versions.
Nothing outside this folder imports it.
"""
