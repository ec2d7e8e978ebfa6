"""Train a small byte-level GPT twice from one seed -- once with PyTorch's SDPA, once with
flashgen.attention -- and compare the loss curves and the throughput.

    python examples/train_gpt.py                                  # 6 layers x 6 heads of 64, T=1024, 300 steps
    python examples/train_gpt.py --plot /tmp/losses.png           # the loss curves as a PNG too
    python examples/train_gpt.py --compile --json runs.json       # under torch.compile, curves to JSON
    python examples/train_gpt.py --device cpu --attention-only sdpa \\
        --layers 2 --heads 2 --embd 64 --block 128 --batch 4 --steps 20   # CPU smoke test (no flashgen)

The model is a GPT-2 style decoder: token + learned position embeddings, pre-LayerNorm blocks
(causal self-attention with one fused qkv projection, a 4x GELU MLP), a final LayerNorm and an LM
head tied to the token embedding. No dropout, so the two runs differ only in the attention op.

The corpus is byte-level (vocab 256): the Python standard library's own *.py sources, sorted by
path and concatenated (site-packages left out), so it exists on any machine with Python. The first
90% trains, the last 10% validates. Both runs draw identical batches from one seeded generator.

On CUDA the default precision is bf16 autocast over fp32 parameters (AdamW state stays fp32);
q, k, v are cast to the autocast dtype explicitly before attention, so both ops see the same bf16
inputs. flashgen needs CUDA and fp16/bf16; on CPU only the SDPA run is possible.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not

try:
    import flashgen
except ImportError as e:  # the SDPA run still works (e.g. on a CPU-only machine without flashgen's deps)
    flashgen, FLASHGEN_IMPORT_ERROR = None, e

ATTENTIONS = ("sdpa", "flashgen")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------------------- corpus

def build_corpus(max_bytes: int = 40_000_000, root: str | None = None) -> torch.Tensor:
    """The standard library's *.py files (sorted by path, site-packages skipped) concatenated as
    bytes, at most max_bytes of them, as a uint8 tensor."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort()
    chunks, total = [], 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, train_fraction: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(len(data) * train_fraction)
    return data[:n], data[n:]


def get_batch(data: torch.Tensor, batch: int, block: int, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): batch random windows of block bytes and the same windows shifted by one."""
    starts = torch.randint(len(data) - block - 1, (batch,), generator=generator)
    windows = data[starts[:, None] + torch.arange(block + 1)].long()
    if torch.device(device).type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 1024
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: str):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attention = attention
        self.compute_dtype: torch.dtype | None = None  # set by train(): the autocast dtype
        self.deterministic = False  # flashgen only: dq without atomics (bitwise reproducible)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, d): a view of the qkv activation, last dimension contiguous
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.compute_dtype is not None and q.dtype != self.compute_dtype:
            q, k, v = (t.to(self.compute_dtype) for t in (q, k, v))
        if self.attention == "flashgen":
            if flashgen is None:
                raise RuntimeError(f"flashgen failed to import: {FLASHGEN_IMPORT_ERROR}")
            if q.dtype in (torch.float16, torch.bfloat16):
                y = flashgen.attention(q, k, v, causal=True, deterministic=self.deterministic)
            else:  # flashgen takes fp16/bf16 only: an fp32 model attends in bf16
                y = flashgen.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                                       deterministic=self.deterministic).to(q.dtype)
        elif self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTIONS}")
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.set_attention(attention)
        self.apply(self._init_weights)
        # residual projections scaled down by depth, GPT-2 style
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_attention(self, attention: str, compute_dtype: torch.dtype | None = None, deterministic: bool = False) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTIONS}")
        for block in self.blocks:
            block.attn.attention = attention
            block.attn.compute_dtype = compute_dtype
            block.attn.deterministic = deterministic

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} > block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


# ------------------------------------------------------------------------------------- training

def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matmul weights and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases and LayerNorm
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def train(
    attention: str,
    config: GPTConfig,
    steps: int = 300,
    seed: int = 0,
    *,
    batch: int = 8,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    init_state: dict | None = None,
    device: str | None = None,
    dtype: str | None = None,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    warmup: int | None = None,
    grad_clip: float = 1.0,
    log_every: int = 10,
    timing_skip: int | None = None,
    eval_batches: int = 10,
    compile: bool = False,
    deterministic: bool = False,
    verbose: bool = True,
) -> dict:
    """Train a fresh GPT (weights from `seed`, or init_state) with one attention op.

    Returns dict(attention, steps=[logged step numbers], losses=[train loss at those steps, the
    loss of that step's batch before its update], val_loss, tokens_per_s, seconds). Batches come
    from a generator seeded with `seed`, so two calls with one seed see identical data. Throughput
    leaves out the first `timing_skip` steps (kernel compilation, autotuning, torch.compile).
    """
    device = torch.device(device or default_device())
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    amp_dtype = DTYPES[dtype]
    use_amp = amp_dtype != torch.float32
    if attention == "flashgen" and device.type != "cuda":
        raise RuntimeError("flashgen.attention needs a CUDA device; use attention='sdpa' on CPU")
    train_data, val_data = data if data is not None else split_corpus(build_corpus())
    warmup = max(1, min(30, steps // 10)) if warmup is None else warmup
    timing_skip = min(5, steps // 4) if timing_skip is None else timing_skip

    torch.manual_seed(seed)  # the same weights for every attention op
    model = GPT(config, attention)
    if init_state is not None:
        model.load_state_dict(init_state)
    model.set_attention(attention, amp_dtype if use_amp else None, deterministic)
    model.to(device)
    optimizer = make_optimizer(model, lr, weight_decay, device)
    step_model = torch.compile(model) if compile else model
    gen = torch.Generator().manual_seed(seed)

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp)

    logged_steps, losses = [], []
    t0 = None
    for step in range(steps):
        if step == timing_skip:
            _sync(device)
            t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = get_batch(train_data, batch, config.block_size, gen, device)
        with autocast():
            _, loss = step_model(x, y)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            logged_steps.append(step)
            losses.append(loss.item())
            if verbose:
                print(f"  [{attention}] step {step:5d}  loss {losses[-1]:.4f}", flush=True)
    _sync(device)
    seconds = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = steps - timing_skip
    tokens_per_s = timed * batch * config.block_size / seconds if timed > 0 else float("nan")

    model.eval()
    val_gen = torch.Generator().manual_seed(seed + 1)
    val = []
    with torch.no_grad(), autocast():
        for _ in range(eval_batches):
            x, y = get_batch(val_data, batch, config.block_size, val_gen, device)
            val.append(step_model(x, y)[1].item())
    val_loss = sum(val) / len(val) if val else float("nan")
    if verbose:
        print(f"  [{attention}] val loss {val_loss:.4f}, {tokens_per_s:,.0f} tokens/s", flush=True)
    return dict(
        attention=attention, steps=logged_steps, losses=losses, val_loss=val_loss,
        tokens_per_s=tokens_per_s, seconds=seconds, timed_steps=timed,
    )


def compare(
    config: GPTConfig,
    steps: int = 300,
    seed: int = 0,
    attentions: tuple[str, ...] = ATTENTIONS,
    *,
    max_bytes: int = 40_000_000,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: str | None = None,
    **train_kwargs,
) -> dict:
    """Train once per attention op from the same initial weights and batches.

    Returns dict(config, runs={attention: train() result}, max_abs_diff, final_abs_diff); the
    diffs are over the logged train losses and present only when both sdpa and flashgen ran.
    flashgen is skipped (with a message) when the device is not CUDA.
    """
    device = device or default_device()
    if torch.device(device).type != "cuda" and "flashgen" in attentions:
        print("flashgen needs CUDA: skipping the flashgen run on", device, flush=True)
        attentions = tuple(a for a in attentions if a != "flashgen")
    if data is None:
        corpus = build_corpus(max_bytes)
        data = split_corpus(corpus)
        print(f"corpus: {len(corpus) / 1e6:.1f} MB of stdlib Python source "
              f"({len(data[0]) / 1e6:.1f} MB train, {len(data[1]) / 1e6:.1f} MB val)", flush=True)
    torch.manual_seed(seed)
    init_state = copy.deepcopy(GPT(config).state_dict())  # one initialization for every run
    n_params = sum(v.numel() for k, v in init_state.items() if k != "lm_head.weight")
    print(f"model: {config.n_layer} layers, {config.n_head} heads x {config.n_embd // config.n_head}, "
          f"block {config.block_size}, {n_params / 1e6:.2f} M parameters", flush=True)
    runs = {}
    for attention in attentions:
        print(f"training with {attention} ...", flush=True)
        runs[attention] = train(attention, config, steps, seed, data=data, init_state=init_state,
                                device=device, **train_kwargs)
    return summarize(runs, config, steps, seed, device)


def summarize(runs: dict, config: GPTConfig, steps: int, seed: int, device) -> dict:
    """compare()'s result from train() results keyed by attention op."""
    result = dict(config=asdict(config), train_steps=steps, seed=seed, device=str(device), runs=runs)
    if "sdpa" in runs and "flashgen" in runs:
        diffs = [abs(a - b) for a, b in zip(runs["sdpa"]["losses"], runs["flashgen"]["losses"])]
        result["abs_diffs"] = diffs
        result["max_abs_diff"] = max(diffs)
        result["final_abs_diff"] = diffs[-1]
    return result


def report(result: dict) -> str:
    runs = result["runs"]
    names = list(runs)
    both = "max_abs_diff" in result
    header = f"{'step':>6}" + "".join(f"{n + ' loss':>15}" for n in names) + (f"{'|diff|':>12}" if both else "")
    lines = [header]
    for i, step in enumerate(runs[names[0]]["steps"]):
        row = f"{step:>6}" + "".join(f"{runs[n]['losses'][i]:>15.4f}" for n in names)
        if both:
            row += f"{result['abs_diffs'][i]:>12.4f}"
        lines.append(row)
    lines.append("")
    for n in names:
        r = runs[n]
        lines.append(f"{n:>9}: final train loss {r['losses'][-1]:.4f} (first {r['losses'][0]:.4f}), "
                     f"val loss {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s "
                     f"(steps {result['train_steps'] - r['timed_steps']}..{result['train_steps'] - 1} timed)")
    if both:
        speedup = runs["flashgen"]["tokens_per_s"] / runs["sdpa"]["tokens_per_s"]
        lines.append(f"max |sdpa - flashgen| over logged steps: {result['max_abs_diff']:.4f} "
                     f"(final {result['final_abs_diff']:.4f}); flashgen/sdpa throughput {speedup:.3f}x")
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    """Both loss curves (and their difference, when both ran) to a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    both = "max_abs_diff" in result
    fig, axes = plt.subplots(2 if both else 1, 1, figsize=(8, 7 if both else 4.5), sharex=True, squeeze=False)
    ax = axes[0][0]
    for name, r in result["runs"].items():
        ax.plot(r["steps"], r["losses"], label=f"{name} ({r['tokens_per_s']:,.0f} tok/s)",
                linestyle="-" if name == "sdpa" else "--")
    c = result["config"]
    ax.set_title(f"byte-level GPT, {c['n_layer']}L x {c['n_head']}H x {c['n_embd'] // c['n_head']}, T={c['block_size']}")
    ax.set_ylabel("train loss (nats/byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    if both:
        diff_ax = axes[1][0]
        diff_ax.plot(result["runs"]["sdpa"]["steps"], result["abs_diffs"], color="tab:red")
        diff_ax.set_ylabel("|sdpa - flashgen|")
        diff_ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=1024, help="sequence length T (and the position table size)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--embd", type=int, default=384, help="model width; head_dim = embd / heads")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default=default_device())
    p.add_argument("--dtype", choices=DTYPES, default=None, help="autocast dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attention-only", choices=ATTENTIONS, default=None, help="train with one op only")
    p.add_argument("--max-bytes", type=int, default=40_000_000, help="corpus size cap")
    p.add_argument("--deterministic", action="store_true", help="flashgen's deterministic backward")
    p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    p.add_argument("--plot", metavar="PATH", default=None, help="write the loss curves to this PNG (needs matplotlib; none by default)")
    p.add_argument("--json", default=None, help="write curves and throughput to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no per-step lines while training")
    args = p.parse_args(argv)

    if args.embd % args.heads:
        p.error(f"--embd {args.embd} is not a multiple of --heads {args.heads}")
    config = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    attentions = (args.attention_only,) if args.attention_only else ATTENTIONS
    if "flashgen" in attentions and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0)):
        sys.exit(f"{p.prog} needs an NVIDIA GPU (sm_80+) for flashgen; PyTorch sees none on this machine "
                 "(--attention-only sdpa trains with SDPA alone)")
    result = compare(
        config, args.steps, args.seed, attentions, max_bytes=args.max_bytes, device=args.device,
        batch=args.batch, dtype=args.dtype, lr=args.lr, log_every=args.log_every, compile=args.compile,
        deterministic=args.deterministic, verbose=not args.quiet,
    )
    print()
    print(report(result))
    if args.plot:
        if plot(result, args.plot):
            print(f"plot: {args.plot}")
        else:
            print("matplotlib not importable: no plot")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"json: {args.json}")
    return result


if __name__ == "__main__":
    main()
