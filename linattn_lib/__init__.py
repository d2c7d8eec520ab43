"""linattn_lib: linear attention, exact references and fast kernels.

Layout everywhere is (B, H, T, D), like torch.nn.functional.scaled_dot_product_attention.

The package, by folder (the arrows run one way: experiments and chapters use core):

* `core/`: the mathematics (softmax, `linear_attention` and its backends, decoding, feature
  maps, Performer, positions, SSMs); imports only `core/`, `_validate` and the kernels;
* `nn/`: modules and the small model zoo;
* `distributed/`: sequence parallelism on torch.distributed;
* `chapters/`: helpers only the book uses (plots, widgets, cost models, estimators, ...);
* `experiments/`: the `python -m` commands (MQAR, char-LM, complexity, bench, gpu_check; the
  distributed demo is `python -m linattn_lib.distributed`);
* `kernels` (the top-level `kernels/` folder): the Triton kernels.

Bad input raises an exception naming the argument. Shapes, dtypes and devices are always
checked; tensor values (NaN, inf, a log-decay > 0) are checked for CPU tensors, and for CUDA
tensors only when opted in with LINATTN_CHECK_VALUES=1 (or `linattn_lib._validate.
CHECK_DEVICE_VALUES = True`): on CUDA a value check is a pass over the data and a device-to-
host sync on every call, which the training hot path does not pay by default.
"""
from .core.decode import KVCacheDecoder, RecurrentDecoder, linear_attention_decode_step
from .core.delta import delta_rule_attention, delta_rule_decode_step
from .core.features import (
    RandomFeatureMap,
    clipped_trig_features,
    default_num_features,
    elu_plus_one,
    gaussian_kernel,
    gaussian_matrix,
    hyperbolic_random_features,
    orthogonal_gaussian_matrix,
    positive_random_features,
    random_projection,
    relu,
    rff_features,
    softmax_kernel,
    taylor_features,
    taylor_kernel,
    trig_softmax_features,
)
from .core.gla import gla_chunkwise
from .core.linear import linear_attention
from .core.masks import causal_mask, decay_mask, segsum
from .core.performer import performer_attention
from .core.positional import (
    band_bias_attention,
    band_bias_matrix,
    cosformer_attention,
    cosformer_attention_matrix,
    cosformer_weights,
    key_normalized_attention,
    key_normalized_attention_matrix,
    sinusoidal_positions,
)
from .core.rotary import rotary_angles, rotary_embedding, rotary_linear_attention, rotary_linear_attention_matrix
from .core.softmax import softmax_attention, softmax_attention_weights
from .core.ssm import (
    gla_attention,
    retnet_log_decay,
    rwkv4_wkv,
    rwkv6_attention,
    selective_scan_reference,
    semiseparable_matrix,
    ssd,
    zoh_discretize,
)
from .core.state import LinearAttentionState
from .distributed import launch, ring_attention, sequence_parallel_linear_attention
from .nn import LinearAttention, ModelConfig, TinyLM

__version__ = "0.1.0"

__all__ = [
    "LinearAttentionState",
    "linear_attention",
    "softmax_attention",
    "linear_attention_decode_step",
    "softmax_attention_weights",
    "RandomFeatureMap",
    "clipped_trig_features",
    "default_num_features",
    "elu_plus_one",
    "gaussian_kernel",
    "gaussian_matrix",
    "hyperbolic_random_features",
    "orthogonal_gaussian_matrix",
    "positive_random_features",
    "random_projection",
    "relu",
    "rff_features",
    "softmax_kernel",
    "taylor_features",
    "taylor_kernel",
    "trig_softmax_features",
    "performer_attention",
    "band_bias_attention",
    "band_bias_matrix",
    "cosformer_attention",
    "cosformer_attention_matrix",
    "cosformer_weights",
    "key_normalized_attention",
    "key_normalized_attention_matrix",
    "sinusoidal_positions",
    "rotary_angles",
    "rotary_embedding",
    "rotary_linear_attention",
    "rotary_linear_attention_matrix",
    "gla_attention",
    "gla_chunkwise",
    "retnet_log_decay",
    "rwkv4_wkv",
    "rwkv6_attention",
    "selective_scan_reference",
    "semiseparable_matrix",
    "ssd",
    "zoh_discretize",
    "delta_rule_attention",
    "delta_rule_decode_step",
    "KVCacheDecoder",
    "RecurrentDecoder",
    "LinearAttention",
    "ModelConfig",
    "TinyLM",
    "sequence_parallel_linear_attention",
    "ring_attention",
    "launch",
    "segsum",
    "decay_mask",
    "causal_mask",
]


def __getattr__(name: str) -> object:
    """`linattn_lib.kernels` (and `from linattn_lib import kernels`) from a source checkout too:
    an install maps the top-level kernels/ folder to that name (setup.py); with only PYTHONPATH
    set, `core.triton_ops.load_kernels` loads the folder under it on first use."""
    if name == "kernels":
        from .core.triton_ops import kernels_import_error, load_kernels

        module = load_kernels()
        if module is None:
            raise ImportError(f"linattn_lib.kernels does not import: {kernels_import_error()}")
        return module
    raise AttributeError(f"module 'linattn_lib' has no attribute {name!r}")
