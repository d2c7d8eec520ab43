"""Communication for sequence parallelism: the two collectives, byte accounting, clear errors.

Every collective of `sequence_parallel.py` and `ring.py` goes through `_all_gather` or
`_send_recv`, which

* count the bytes this rank sends into an optional `CommLog` (and, on gloo under Linux, the
  bytes the operating system saw the process write, `os_bytes_written`), and
* turn a failure or time-out of a peer into a `PeerFailureError` that says what happened.

`_check_same_on_every_rank` is the check each public function runs before its first real
collective: one all-gather of a descriptor of its arguments (shapes, dtype, device type,
options), so that arguments that differ between ranks raise the same clear `ValueError` on
every rank instead of a mismatched collective that aborts, hangs or mixes up buffers.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommLog", "CommRecord", "PeerFailureError", "os_bytes_written"]


# --------------------------------------------------------------------------------------
# communication: counting bytes, clear errors
# --------------------------------------------------------------------------------------


def os_bytes_written() -> int | None:
    """Bytes this process has written through write-like system calls (Linux /proc/self/io).

    gloo's TCP transport sends with writev(2), so the change of this counter around a gloo
    collective is the number of bytes the process actually handed to its sockets (payload plus
    gloo's small message headers). None where /proc is not available. It sees nothing of NCCL,
    whose transfers do not go through the CPU's sockets.
    """
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class CommRecord:
    """One communication call as seen by one rank.

    op: "all_gather" or "send_recv"; what: what was communicated.
    payload: bytes of the tensor this rank contributes (all_gather) or sends (send_recv).
    sent: bytes this rank sends. In an all-gather that is (W - 1) * payload, whether it runs as
        a ring (each rank forwards every block it receives, once) or as direct sends of the
        block to the W - 1 other ranks. A send is its payload.
    received: bytes this rank receives.
    os_sent: bytes the operating system saw this process write during the call (gloo on Linux;
        None otherwise): the measured counterpart of `sent`, plus transport headers.
    seconds: wall time of the call.
    """

    op: str
    what: str
    payload: int
    sent: int
    received: int
    os_sent: int | None
    seconds: float


@dataclass
class CommLog:
    """The communication of one rank, recorded by the functions of this module (pass comm=...)."""

    records: list[CommRecord] = field(default_factory=list)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    @property
    def sent(self) -> int:
        """Bytes sent, counted from the tensors handed to the collectives."""
        return sum(r.sent for r in self.records)

    @property
    def received(self) -> int:
        return sum(r.received for r in self.records)

    @property
    def os_sent(self) -> int | None:
        """Bytes the OS saw written during the calls (None if any call could not measure it)."""
        vals = [r.os_sent for r in self.records]
        return None if any(v is None for v in vals) else sum(vals)

    @property
    def calls(self) -> int:
        return len(self.records)

    def summary(self) -> dict[str, int | None]:
        return {"calls": self.calls, "sent": self.sent, "received": self.received, "os_sent": self.os_sent}


class PeerFailureError(RuntimeError):
    """A collective failed on this rank because another rank failed, exited or stalled."""


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group first "
            "(or start the function with linattn_lib.distributed.launch, or under torchrun)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _measures_os_bytes(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _peer_error(what: str, op: str, rank: int, world: int, err: BaseException) -> PeerFailureError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PeerFailureError(
        f"rank {rank} of {world}: {op} of {what} failed -- another rank of the process group "
        f"probably failed, exited or stalled past the collective timeout. Underlying error: {first}"
    )


def _all_gather(x: Tensor, group: dist.ProcessGroup | None, comm: CommLog | None, what: str) -> list[Tensor]:
    rank, world = _group_info(group)
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    w0 = os_bytes_written() if _measures_os_bytes(group) else None
    t0 = time.perf_counter()
    try:
        dist.all_gather(out, x, group=group)
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
        raise _peer_error(what, "all_gather", rank, world, e) from e
    seconds = time.perf_counter() - t0
    if comm is not None:
        w1 = os_bytes_written() if w0 is not None else None
        n = x.numel() * x.element_size()
        comm.add(CommRecord("all_gather", what, n, (world - 1) * n, (world - 1) * n,
                            None if w1 is None else w1 - w0, seconds))
    return out


def _send_recv(send: Tensor | None, dst: int, recv: Tensor | None, src: int,
               group: dist.ProcessGroup | None, comm: CommLog | None, what: str) -> None:
    """Send `send` to rank dst while receiving `recv` from rank src (either may be None)."""
    rank, world = _group_info(group)
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, dst) if group else dst, group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src) if group else src, group))
    if not ops:
        return
    w0 = os_bytes_written() if _measures_os_bytes(group) else None
    t0 = time.perf_counter()
    try:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    except RuntimeError as e:
        raise _peer_error(what, "send/recv", rank, world, e) from e
    seconds = time.perf_counter() - t0
    if comm is not None:
        w1 = os_bytes_written() if w0 is not None else None
        ns = 0 if send is None else send.numel() * send.element_size()
        nr = 0 if recv is None else recv.numel() * recv.element_size()
        comm.add(CommRecord("send_recv", what, ns, ns, nr, None if w1 is None else w1 - w0, seconds))


# --------------------------------------------------------------------------------------
# the same arguments on every rank: one small all-gather before the real collectives
# --------------------------------------------------------------------------------------

# Categorical arguments travel as their index in these tuples (the same on every rank of one
# installation). Sorted by name, so that the order does not depend on how torch lists them.
_FLOAT_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point},
                             key=str))
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "meta")
_DECAY_KINDS = ("None", "per-head (H,)", "per-token (B, H, T_r)")


@dataclass(frozen=True)
class _Arg:
    """One entry of the descriptor: its value, and how to say it -- `first` for the first value
    in the error message, `rest` for the others, each a format string with one field. `choices`
    encodes a categorical value as its index (-1: none of them)."""

    first: str
    rest: str
    value: Any
    choices: tuple | None = None

    def code(self) -> float:
        if self.choices is not None:
            return float(self.choices.index(self.value)) if self.value in self.choices else -1.0
        return float(self.value)

    def show(self, code: float, template: str) -> str:
        if self.choices is not None:
            value = self.choices[int(code)] if code >= 0 else "(unlisted)"
        elif isinstance(self.value, bool):
            value = bool(code)
        elif isinstance(self.value, int):
            value = int(code)
        else:
            value = code
        return template.format(value)


def _rank_list(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0, 2", "ranks 0-5, 7": consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _descriptor_device(group: dist.ProcessGroup | None, x: Tensor) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":  # CPU collectives ("cpu:gloo,cuda:nccl" too)
        return torch.device("cpu")
    if "nccl" in backend:  # the GPU of this rank, whatever device the caller's tensors are on
        return torch.device("cuda", torch.cuda.current_device())
    return x.device


def _check_same_on_every_rank(fn: str, args: Sequence[_Arg], group: dist.ProcessGroup | None,
                              x: Tensor) -> None:
    """Raise on every rank if any argument differs between the ranks of `group`.

    The collectives that follow exchange buffers whose sizes and meaning follow from these
    arguments; a rank that disagrees would abort the process (gloo: "Received data size
    doesn't match expected size"), hang, or -- when the byte counts happen to agree -- return
    a finite, wrong result. One all-gather of len(args) float64 numbers (exact for these ints
    and floats) lets every rank see every rank's values, so all of them raise the same error.
    It is not recorded in a `CommLog`: it is a check, not part of the algorithm's traffic.
    """
    rank, world = _group_info(group)
    if world == 1:
        return
    mine = torch.tensor([a.code() for a in args], dtype=torch.float64, device=_descriptor_device(group, x))
    table = torch.stack(_all_gather(mine, group, None, "argument descriptor (shapes, dtype, options)")).cpu()
    problems = []
    for i, a in enumerate(args):
        column = table[:, i].tolist()
        values = list(dict.fromkeys(column))  # in order of first appearance
        if len(values) == 1:
            continue
        parts = [a.show(v, a.first if j == 0 else a.rest) + " on "
                 + _rank_list([r for r, c in enumerate(column) if c == v]) for j, v in enumerate(values)]
        problems.append(parts[0] + " but " + " and ".join(parts[1:]))
    if problems:
        raise ValueError(f"{fn}: {'; '.join(problems)}; expected the same on every rank of the process group "
                         f"(this is rank {rank} of {world})")


def _layout_args(q: Tensor, v: Tensor) -> list[_Arg]:
    """The descriptor entries every rank must share for q, k, v: B, H, Dk, Dv, dtype, device type."""
    B, H, _, Dk = q.shape
    return [
        _Arg("`q` has B={}", "B={}", B), _Arg("`q` has H={}", "H={}", H),
        _Arg("`q` has Dk={}", "Dk={}", Dk), _Arg("`v` has Dv={}", "Dv={}", v.shape[-1]),
        _Arg("`q` has dtype {}", "{}", q.dtype, _FLOAT_DTYPES),
        _Arg("`q` has device type {}", "{}", q.device.type, _DEVICE_TYPES),
    ]

