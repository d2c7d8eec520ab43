"""A helper shared by the layer tests: a layer run token by token from its own state."""
from __future__ import annotations

import torch


def decode_stepwise(layer, x: torch.Tensor, start: int):
    """The first `start` tokens of x in parallel, then one token at a time from the returned
    state (generation); returns (the outputs of every token, the final state)."""
    y, state = layer(x[:, :start], return_state=True)
    steps = [y]
    for t in range(start, x.shape[1]):
        y, state = layer(x[:, t:t + 1], state=state, pos_offset=t, return_state=True)
        steps.append(y)
    return torch.cat(steps, dim=1), state
