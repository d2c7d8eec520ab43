"""Sequence parallelism for linear attention on `torch.distributed` (chapter 9).

The package, by what each module holds (the arrows of its imports run down this list):

* `comm.py` -- the two collectives, with byte accounting (`CommLog`), clear errors when a
  peer fails (`PeerFailureError`) and the check that every rank got the same arguments;
* `sequence_parallel.py` -- the algorithm: local states, the scan over ranks and its reverse,
  `sequence_parallel_linear_attention`, its byte count, `split_sequence` / `shard_sequence`;
* `ring.py` -- the softmax baseline, `ring_attention` (forward only), and its byte count;
* `launcher.py` -- `launch`: W local processes joined in a process group (loopback only);
* `harness.py` -- rank functions that check and measure, for the tests and the book;
* `cli.py` -- `main`, the check behind `python -m linattn_lib.distributed` (`__main__.py`).

Nothing here plots: the chapter's picture of the two scans is
`linattn_lib.chapters.distributed_plots.draw_rank_scan`.
"""
from .cli import main
from .comm import CommLog
from .harness import (
    check_rank,
    compare_with_reference,
    failing_rank,
    make_inputs,
    measure_rank,
    single_process_reference,
)
from .launcher import DistributedRunError, launch
from .ring import ring_attention, ring_attention_bytes_per_rank
from .sequence_parallel import (
    linear_sp_bytes_per_rank,
    local_state,
    prefix_states,
    prefix_states_backward,
    sequence_parallel_linear_attention,
    shard_sequence,
    split_sequence,
)

__all__ = [
    "CommLog",
    "DistributedRunError",
    "check_rank",
    "compare_with_reference",
    "failing_rank",
    "launch",
    "linear_sp_bytes_per_rank",
    "local_state",
    "main",
    "make_inputs",
    "measure_rank",
    "prefix_states",
    "prefix_states_backward",
    "ring_attention",
    "ring_attention_bytes_per_rank",
    "sequence_parallel_linear_attention",
    "shard_sequence",
    "single_process_reference",
    "split_sequence",
]
