"""flashgen as a Hugging Face `transformers` attention implementation.

    import flashgen.integrations.transformers as fg_hf
    fg_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fg_hf.NAME)

`NAME` is "fgen": transformers takes any name holding "flash" for one of its own FlashAttention or
hub-kernel implementations and tries to load that, so "flashgen" itself cannot be registered.

What transformers passes is read as its FlashAttention path reads it: query/key/value as
(batch, heads, length, d) with fewer key/value heads under GQA (never repeated here), `scaling`,
`sliding_window`, `softcap`, `is_causal`, and the attention mask as the 2-D (batch, kv length)
padding mask that transformers' `flash_attention_mask` makes (None when nothing is padded).
A sliding window shorter than the keys becomes FlashAttention's `window_size=(sliding_window - 1,
sliding_window - 1)`, the right side 0 when causal: a query sees itself and the `sliding_window - 1`
keys before it, which is transformers' own sliding-window mask for sdpa and eager
(`sliding_window_overlay`: kv_idx > q_idx - sliding_window) and its flash path's window. A softcap
(Gemma-2's attn_logit_softcapping) is passed as `softcap`: softcap * tanh(scores / softcap), as
eager computes it. A padded batch is run exactly: the real tokens of each row are gathered into
one packed batch for `flashgen.attention_varlen` (so no work and no probability mass goes to
padding) and scattered back; padded query rows come out as zeros. The window then counts a row's
real tokens, as the flash path does; for left- or right-padded rows that is also what the sdpa and
eager masks count (their positions include the padding, but it lies all on one side).

The cases are taken in the flash path's order: a padding mask (above; a mask shorter than the
keys is a static cache's, whose first slots hold the tokens: the keys are cut to it); packed
sequences with `cu_seq_lens_q`/`cu_seq_lens_k` from a data collator, any batch flattened, to
`attention_varlen` directly; packed sequences that only `position_ids` mark (a collator's
flattening: each sequence restarts at the smallest position), cut there; else `attention`. Queries
are masked like the keys when there are as many, all kept for one query (a decoding step), else
the last ones when causal (a step over a cache); a non-causal attention with other lengths
(cross-attention) keeps every query row.
"""

from __future__ import annotations

import torch

NAME = "fgen"


def register(name: str = NAME) -> str:
    """Make `name` an `attn_implementation` transformers models accept; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if "flash" in name:
        raise ValueError(f"name={name!r}: transformers reserves names holding 'flash' for its own kernels")
    AttentionInterface.register(name, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)  # a 2-D padding mask, or None
    return name


def _kernels():
    """The two entry points the hook calls (the tests put the CPU oracle's in their place)."""
    import flashgen

    return flashgen.attention, flashgen.attention_varlen


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention hook: returns (output (batch, length, heads, d), None)."""
    attention, attention_varlen = _kernels()
    if dropout and module.training:
        raise ValueError(f"dropout={dropout}: flashgen has no attention dropout (set the config's attention_dropout to 0)")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True needs the probabilities, which flashgen never forms: use eager")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = {}  # the variants this model uses, in FlashAttention's keywords (none: the plain kernels)
    if sliding_window is not None and sliding_window < key.shape[2]:
        options["window_size"] = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    if softcap:
        options["softcap"] = float(softcap)
    if s_aux is not None:  # gpt-oss' attention sinks: a logit per query head, in the model's dtype
        options["learnable_sink"] = s_aux.float()

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None:
        out = _padded(attention_varlen, query, key, value, attention_mask, is_causal, scaling, options)
    elif cu_q is not None and cu_k is not None:
        out = _packed(attention_varlen, query, key, value, cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]),
                      is_causal, scaling, options)
    elif _packed_by_positions(position_ids, query.shape[0]):
        cu = _starts(position_ids)
        out = _packed(attention_varlen, query, key, value, cu, cu, int(cu.diff().max()), int(cu.diff().max()), is_causal,
                      scaling, options)
    else:
        out = attention(query, key, value, causal=is_causal, scale=scaling, **options).transpose(1, 2)
    return out.contiguous(), None  # (V may have a head dim of its own, as in DeepSeek's MLA: the output has it)


def _packed(attention_varlen, query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, options):
    """Sequences packed along the length (of every batch row, flattened), through the varlen kernel."""
    flat = [t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3]) for t in (query, key, value)]
    out = attention_varlen(*flat, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, causal=causal, softmax_scale=scale,
                           **options)
    return out.view(query.shape[0], query.shape[2], *out.shape[1:])


def _packed_by_positions(position_ids, batch: int) -> bool:
    """transformers' test for sequences packed into one row that only position_ids mark: one row
    of more than one position that is not a single increasing run."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return False
    run = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((run - position_ids).abs().sum())


def _starts(position_ids) -> torch.Tensor:
    """cu_seqlens of sequences that each restart at the smallest position (transformers' rule)."""
    flat = position_ids.reshape(-1)
    starts = (flat == flat.min()).nonzero().view(-1)
    return torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)


def _padded(attention_varlen, query, key, value, mask, causal, scale, options):
    """A padded batch through the varlen kernel: gather each row's real tokens, attend, scatter back.
    Keys past the mask are a static cache's empty slots (its first slots hold the tokens). The
    queries' mask is the keys' when there are as many, none for one query, else the keys' last
    columns when causal (a step over a cache); a non-causal call with other lengths
    (cross-attention) keeps every query."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"attention_mask: expected the 2-D bool padding mask of flash_attention_mask, got {mask.dtype} {tuple(mask.shape)}")
    batch, _, seqlen_q, _ = query.shape
    if key.shape[2] > mask.shape[1]:
        key, value = key[:, :, : mask.shape[1]], value[:, :, : mask.shape[1]]
    mask_k = mask[:, -key.shape[2]:]
    if seqlen_q == key.shape[2]:
        mask_q = mask_k
    elif seqlen_q == 1 or not causal:
        mask_q = torch.ones(batch, seqlen_q, dtype=torch.bool, device=mask.device)
    else:
        mask_q = mask_k[:, -seqlen_q:]

    def pack(x, keep):  # (B, H, T, d) -> (real tokens, H, d)
        return x.transpose(1, 2)[keep]

    def offsets(keep):
        lengths = keep.sum(dim=1, dtype=torch.int32)
        return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)), int(lengths.max())

    (cu_q, max_q), (cu_k, max_k) = offsets(mask_q), offsets(mask_k)
    packed = attention_varlen(
        pack(query, mask_q), pack(key, mask_k), pack(value, mask_k), cu_q, cu_k, max(max_q, 1), max(max_k, 1),
        causal=causal, softmax_scale=scale, **options,
    )
    out = packed.new_zeros(batch, seqlen_q, *packed.shape[1:])
    out[mask_q] = packed
    return out
