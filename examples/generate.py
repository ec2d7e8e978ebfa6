"""Serve a small Llama with flashgen: a batch of prompts of different lengths is prefilled through
`flashgen.attention_varlen` (packed, no padding) into a paged KV cache, then decoded token by token
with `flashgen.attention_with_kvcache` inside one captured CUDA graph.

    python examples/generate.py                       # 4 prompts, 64 new tokens, page size 16
    python examples/generate.py --new-tokens 256 --page-size 64 --batch 8

The model is a randomly initialised `transformers` Llama built from a config (GQA: 16 query heads
on 4 key/value heads of 64; nothing is downloaded), run with its own modules (embeddings, RMSNorm,
rotary embedding, projections, MLP); only the attention and the cache are flashgen's. The script
checks each step's logits against the same model run by `transformers` with its SDPA attention
and prints tokens/s next to `transformers`' own `generate`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not

import flashgen  # noqa: E402


def small_llama(seed: int = 0, layers: int = 4, dtype=torch.bfloat16, attn_implementation: str = "sdpa"):
    """A random Llama with GQA (16 query heads, 4 KV heads, head dim 64), built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


class PagedLlama:
    """A Llama's weights, driven by flashgen: varlen prefill into a paged cache, graph-captured decode.

    The cache of each layer is (pages, page_size, kv_heads, head_dim); each sequence owns
    `max_len / page_size` pages, handed out in a shuffled order so that the block table is
    really followed. `cache_seqlens` (int32, on the GPU) is each sequence's length so far.
    """

    def __init__(self, model, batch: int, max_len: int, page_size: int = 16, seed: int = 0):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model, self.rotate = model, apply_rotary_pos_emb
        config = model.config
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.batch, self.page_size = batch, page_size
        pages_per_seq = -(-max_len // page_size)
        pages = batch * pages_per_seq
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        self.block_table = order.view(batch, pages_per_seq).to(device="cuda", dtype=torch.int32)
        shape = (pages, page_size, self.kv_heads, self.head_dim)
        layers = model.model.layers
        self.k_cache = [torch.zeros(shape, device="cuda", dtype=model.dtype) for _ in layers]
        self.v_cache = [torch.zeros(shape, device="cuda", dtype=model.dtype) for _ in layers]
        self.cache_seqlens = torch.zeros(batch, device="cuda", dtype=torch.int32)
        self.graph = None

    def _project(self, attn, x, positions):
        """q, k, v of hidden states x (N, T, hidden) with rotary applied: each (N, T, heads, d)."""
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, self.kv_heads, self.head_dim)
        cos, sin = self.model.model.rotary_emb(x, positions)
        q, k = self.rotate(q, k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def _block(self, layer, h, attention):
        """One decoder layer around an attention callable (q, k, v) -> (N, T, heads, d)."""
        attn = layer.self_attn
        out = attention(attn, layer.input_layernorm(h))
        h = h + attn.o_proj(out.reshape(*h.shape[:2], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor]) -> torch.Tensor:
        """Run the prompts packed into one varlen batch, write their keys and values into the paged
        cache, and return the logits of each prompt's last token (batch, vocab)."""
        lengths = torch.tensor([len(p) for p in prompts], device="cuda", dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        ids = torch.cat(prompts).cuda()
        seq = torch.repeat_interleave(torch.arange(self.batch, device="cuda"), lengths.long())
        pos = torch.arange(len(ids), device="cuda") - cu[:-1].long()[seq]
        slots = self.block_table[seq, pos // self.page_size].long() * self.page_size + pos % self.page_size
        longest = int(lengths.max())

        def attention(layer_index):
            def run(attn, x):
                q, k, v = self._project(attn, x, pos[None])
                q, k, v = q[0], k[0], v[0]  # (tokens, heads, d)
                self.k_cache[layer_index].view(-1, self.kv_heads, self.head_dim)[slots] = k
                self.v_cache[layer_index].view(-1, self.kv_heads, self.head_dim)[slots] = v
                return flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True,
                                                 softmax_scale=attn.scaling)[None]
            return run

        h = self.model.model.embed_tokens(ids)[None]
        for i, layer in enumerate(self.model.model.layers):
            h = self._block(layer, h, attention(i))
        self.cache_seqlens.copy_(lengths)
        last = self.model.model.norm(h[0, cu[1:].long() - 1])
        return self.model.lm_head(last).float()

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for every sequence: append its token's keys and values to the cache
        (inside the attention kernel), attend, and return the logits (batch, vocab). Shapes and
        addresses never change, so the step can be captured as a CUDA graph."""
        positions = self.cache_seqlens.long()[:, None]

        def attention(layer_index):
            def run(attn, x):
                q, k, v = self._project(attn, x, positions)
                return flashgen.attention_with_kvcache(
                    q, self.k_cache[layer_index], self.v_cache[layer_index], k=k, v=v,
                    cache_seqlens=self.cache_seqlens, block_table=self.block_table, causal=True,
                    softmax_scale=attn.scaling,
                )
            return run

        h = self.model.model.embed_tokens(tokens)[:, None]
        for i, layer in enumerate(self.model.model.layers):
            h = self._block(layer, h, attention(i))
        logits = self.model.lm_head(self.model.model.norm(h[:, 0])).float()
        self.cache_seqlens += 1
        return logits

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step through the captured graph (captured on first use)."""
        if self.graph is None:
            self._capture()
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits.clone()

    def _capture(self):
        self.tokens = torch.zeros(self.batch, device="cuda", dtype=torch.long)
        lengths = self.cache_seqlens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles and loads every kernel) off the graph
            self._step(self.tokens)
        torch.cuda.current_stream().wait_stream(stream)
        self.cache_seqlens.copy_(lengths)  # the warm-up's appends are overwritten by the next step
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step(self.tokens)
        self.cache_seqlens.copy_(lengths)  # capture recorded, not ran; keep the lengths as they were

    def generate(self, prompts: list[torch.Tensor], new_tokens: int):
        """Greedy decoding: (tokens (batch, new_tokens), logits of every step (batch, new_tokens, vocab))."""
        logits = [self.prefill(prompts)]
        tokens = [logits[-1].argmax(-1)]
        for _ in range(new_tokens - 1):
            logits.append(self.decode(tokens[-1]))
            tokens.append(logits[-1].argmax(-1))
        return torch.stack(tokens, 1), torch.stack(logits, 1)


def reference_logits(model, prompts, tokens) -> torch.Tensor:
    """`transformers`' own forward over each prompt + generated tokens: the logits that predicted
    each generated token (batch, new_tokens, vocab)."""
    rows = []
    with torch.no_grad():
        for prompt, generated in zip(prompts, tokens):
            ids = torch.cat([prompt.cuda(), generated[:-1]])[None]
            rows.append(model(ids).logits[0, len(prompt) - 1:].float())
    return torch.stack(rows)


def random_prompts(batch: int, vocab: int, seed: int = 0, shortest: int = 5, longest: int = 300):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def hf_tokens_per_s(model, prompts, new_tokens: int) -> float:
    """`transformers`' generate (left-padded batch, greedy, its static cache off), tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit(f"{parser.prog} needs an NVIDIA GPU (sm_80+); PyTorch sees none on this machine")

    model = small_llama(args.seed, args.layers)
    prompts = random_prompts(args.batch, model.config.vocab_size, args.seed)
    engine = PagedLlama(model, args.batch, max(len(p) for p in prompts) + args.new_tokens, args.page_size, args.seed)
    engine.generate(prompts, 3)  # compile and load the kernels, capture the graph

    engine = PagedLlama(model, args.batch, max(len(p) for p in prompts) + args.new_tokens, args.page_size, args.seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens, logits = engine.generate(prompts, args.new_tokens)
    torch.cuda.synchronize()
    ours = args.batch * args.new_tokens / (time.perf_counter() - start)

    expected = reference_logits(model, prompts, tokens)
    error = (logits - expected).abs().max().item()
    agree = (expected.argmax(-1) == tokens).float().mean().item()
    theirs = hf_tokens_per_s(model, prompts, args.new_tokens)
    print(f"prompts of {[len(p) for p in prompts]} tokens, {args.new_tokens} new tokens each, page size {args.page_size}")
    print(f"logits vs transformers (SDPA): max |diff| {error:.3f}, greedy tokens agree {agree:.1%}")
    print(f"flashgen (varlen prefill + paged decode in a CUDA graph): {ours:,.0f} tokens/s")
    print(f"transformers generate (SDPA):                             {theirs:,.0f} tokens/s")
    print("first sequence:", tokens[0, :16].tolist(), "...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
