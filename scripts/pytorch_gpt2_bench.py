#!/usr/bin/env python3
"""GPT-2 124M training steps in PyTorch: the baseline for braid's ``gpt2_gpu``.

The same model and step as ``benches/src/bin/gpt2_gpu.rs``: GPT-2 small
(``transformers.GPT2Config()``: 12 layers, 12 heads, 768 channels, vocabulary
50257, context 1024, tied embeddings, tanh GELU, no dropout), fp32 with TF32
off, random token ids (new each step), the mean cross-entropy of the logits
against independent random targets (no label shift, as braid), global-norm
clipping at 1.0 and ``torch.optim.AdamW`` (lr 3e-4, betas (0.9, 0.95), eps
1e-8, weight decay 0.1 on every parameter). Warm-up steps, then timed steps,
each between two ``torch.cuda.synchronize()`` calls.

Prints one ``key=value`` line per figure, among them::

    tokens_per_s=...     (B*T / median step time)
    step_ms=...          (median step time)

Usage (on the GPU machine)::

    python3 scripts/pytorch_gpt2_bench.py --batch-size 8 --seq-len 1024
    python3 scripts/pytorch_gpt2_bench.py --batch-size 8 --seq-len 1024 --attn eager

``--attn eager`` materialises the (B, NH, T, T) attention matrices as braid
does (its kernels are llm.c's); ``--attn sdpa`` (the default, Hugging Face's
default too) uses ``scaled_dot_product_attention`` (fused kernels). Without
``transformers`` (or with ``--impl nanogpt``) a minimal nanoGPT-style module
defined here is used instead, with the same parameters and computation.
"""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8, help="B (default 8)")
    p.add_argument("--seq-len", type=int, default=1024, help="T (default 1024)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument(
        "--impl",
        choices=["auto", "hf", "nanogpt"],
        default="auto",
        help="transformers.GPT2LMHeadModel (hf), the module in this script "
        "(nanogpt), or hf when transformers is installed (auto)",
    )
    p.add_argument(
        "--attn",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="attention: fused scaled_dot_product_attention (sdpa) or the "
        "explicit softmax(q k^T) v with (B, NH, T, T) matrices (eager)",
    )
    p.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 (TF32 off), or bf16: torch.autocast to bfloat16 around the "
        "forward pass and the loss, fp32 parameters, gradients and AdamW "
        "state (PyTorch's usual mixed precision)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s the MFU is a share of (default: an H100/H200 SXM's "
        "dense rate, 989 in bf16, 67 in fp32)",
    )
    p.add_argument(
        "--fused-adamw",
        action="store_true",
        help="torch.optim.AdamW(fused=True) instead of the default (foreach)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="gpt2",
        help="braid's configuration of that name (braid-gpt2 --model): gpt2 "
        "(124M, the default), small (4 layers, 4 heads, 128 channels, "
        "vocabulary 50257, context 256) or tiny (2, 4, 64, 512, 64)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: PyTorch's, one per core)",
    )
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    n_ctx = MODELS[args.model][4]
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: must be at least 1")
    if not 1 <= args.seq_len <= n_ctx:
        p.error(
            f"--seq-len {args.seq_len}: must be in 1..={n_ctx} "
            f"(the context of --model {args.model})"
        )
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must not be negative")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least one timed step is needed")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: must be at least 1")
    return args


# braid's named configurations (models/gpt2/src/config.rs):
# (layers, heads, channels, vocabulary, context).
MODELS = {
    "gpt2": (12, 12, 768, 50257, 1024),
    "small": (4, 4, 128, 50257, 256),
    "tiny": (2, 4, 64, 512, 64),
}


# ----- a minimal GPT-2 (nanoGPT style), used without transformers ------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, n_ctx, attn):
        super().__init__()
        self.n_head = n_head
        self.attn = attn
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        mask = torch.tril(torch.ones(n_ctx, n_ctx, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, n_ctx, n_ctx), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        hs = c // self.n_head
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, n_ctx, attn):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head, n_ctx, attn)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.c_proj(h)


class NanoGPT2(nn.Module):
    """GPT-2 without dropout; the head is tied to the token embedding."""

    def __init__(self, vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, n_embd=768, attn="sdpa"):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_ctx, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, n_ctx, attn) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


# ----- the benchmark ----------------------------------------------------------


def build_model(args):
    """Returns (module, forward(idx) -> logits, description)."""
    impl = args.impl
    if impl in ("auto", "hf"):
        try:
            import transformers
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as e:
            if impl == "hf":
                sys.exit(f"--impl hf: transformers is not installed ({e})")
            impl = "nanogpt"
        else:
            n_layer, n_head, n_embd, vocab, n_ctx = MODELS[args.model]
            cfg = GPT2Config(
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                vocab_size=vocab,
                n_positions=n_ctx,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                activation_function="gelu_new",
                layer_norm_epsilon=1e-5,
                attn_implementation=args.attn,
            )
            model = GPT2LMHeadModel(cfg)
            model.config.use_cache = False
            used = getattr(model.config, "_attn_implementation", args.attn)
            if used != args.attn:
                sys.exit(f"--attn {args.attn}: transformers chose {used!r} instead")

            def forward(idx, model=model):
                return model(input_ids=idx, use_cache=False).logits

            desc = f"transformers {transformers.__version__} GPT2LMHeadModel ({args.model})"
            return model, forward, desc
    n_layer, n_head, n_embd, vocab, n_ctx = MODELS[args.model]
    model = NanoGPT2(vocab, n_ctx, n_layer, n_head, n_embd, attn=args.attn)
    return model, model, f"nanoGPT-style module (this script, {args.model})"


def main():
    args = parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to PyTorch; pass --device cpu for a dry run")
    # fp32 throughout, TF32 off (braid's cuBLAS products are plain FP32).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(args.seed)

    model, forward, desc = build_model(args)
    model.to(device=device, dtype=torch.float32)
    model.train()
    if args.compile:
        forward = torch.compile(forward)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=args.fused_adamw or None,
    )
    autocast = torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"
    )
    b, t = args.batch_size, args.seq_len
    n_layer, _, n_embd, vocab, _ = MODELS[args.model]
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step():
        x = torch.randint(0, vocab, (b, t), device=device, generator=gen)
        y = torch.randint(0, vocab, (b, t), device=device, generator=gen)
        opt.zero_grad(set_to_none=False)
        with autocast:
            logits = forward(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        return loss

    print(f"model={desc}")
    print(f"parameters={n_params}")
    print(f"attention={args.attn}")
    print(f"device={torch.cuda.get_device_name(device) if cuda else 'cpu'}")
    if not cuda:
        print(f"threads={torch.get_num_threads()}")
    print(f"torch={torch.__version__}")
    print(f"batch_size={b}")
    print(f"seq_len={t}")
    print(f"dtype={'bfloat16 autocast' if args.dtype == 'bf16' else 'float32'} tf32=off")
    print(f"adamw={'fused' if args.fused_adamw else 'default'}")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync()
    times = []
    loss = None
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"loss={loss.item():.4f}")
    print(f"step_ms={med * 1e3:.2f}")
    print(f"step_ms_mean={statistics.fmean(times) * 1e3:.2f}")
    print(f"step_ms_min={min(times) * 1e3:.2f}")
    print(f"tokens_per_s={b * t / med:.0f}")
    # llm.c's count: 6 FLOPs per parameter and token, plus the attention's
    # 12 * layers * channels * T per token.
    flops = (6 * n_params + 12 * n_layer * n_embd * t) * b * t
    peak = args.peak_tflops or (989.0 if args.dtype == "bf16" else 67.0)
    print(f"mfu={100 * flops / med / (peak * 1e12):.1f}")
    if cuda:
        print(f"peak_memory_gib={torch.cuda.max_memory_allocated(device) / 2**30:.2f}")


if __name__ == "__main__":
    main()
