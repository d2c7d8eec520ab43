"""Sequence parallelism for linear attention on `torch.distributed` (chapter 9).

`python -m linattn_lib.distributed` runs the multi-process check (see `__main__.py`).
"""
from .sequence_parallel import (
    CommLog,
    DistributedRunError,
    check_rank,
    compare_with_reference,
    draw_rank_scan,
    failing_rank,
    launch,
    linear_sp_bytes_per_rank,
    local_state,
    main,
    make_inputs,
    measure_rank,
    prefix_states,
    prefix_states_backward,
    ring_attention,
    ring_attention_bytes_per_rank,
    sequence_parallel_linear_attention,
    shard_sequence,
    single_process_reference,
    split_sequence,
)

__all__ = [
    "CommLog",
    "DistributedRunError",
    "check_rank",
    "compare_with_reference",
    "draw_rank_scan",
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
