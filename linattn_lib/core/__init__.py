"""The mathematics of linear attention: every module here imports only `core/`,
`linattn_lib._validate` and `linattn_lib.kernels` (no plotting, no widgets, no book helpers).

    state.py          the state, the decay and its stable suffix sums (the numerics rule)
    masks.py          causal and decay masks, segment sums
    softmax.py        exact softmax attention, the quadratic baseline
    reference.py      the quadratic, recurrent and chunked forms in plain autograd
    linear.py         `linear_attention`: checks its inputs and picks a backend
    torch_chunked.py  the fast CPU path (blockwise, recomputing backward)
    triton_ops.py     the causal forward and backward around the Triton kernels
    custom_ops.py     those as torch custom ops (autograd, fake shapes, torch.compile)
    varlen.py         packed variable-length sequences (cu_seqlens): checks, the definition
                      (each sequence alone) and the torch paths' padded batches
    decode.py         one token at a time: decoders and the functional decode step
    features.py       feature maps (ELU+1, random features, FAVOR+ and its relatives, Based's
                      Taylor map)
    performer.py      Performer attention
    positional.py     cosFormer, relative-position band bias, key normalisation
    rotary.py         rotary position embedding (RoPE) and RoFormer's linear attention with it
    ssm.py            state-space models: SSD, RetNet, GLA, RWKV-4, RWKV-5/6, selective scan
    gla.py            GLA's chunkwise form with secondary chunking
    delta.py          the delta rule (DeltaNet, Gated DeltaNet): recurrent, chunked (WY/UT), quadratic
    delta_triton.py   the delta rule's Triton kernels (kernels/delta_rule.py) under autograd
    delta_ops.py      those as torch custom ops (torch.compile)
    packed_ops.py     the host paths as one op for torch.compile and torch.func
    func_rules.py     the vmap rule the library's autograd Functions share (torch.func)
    once.py           `once_differentiable`: a computed backward refuses create_graph=True
"""
