#!/usr/bin/env python3
"""Make the PyTorch reference fixtures for braid-gpt2's CPU model.

Writes ``models/gpt2/tests/fixtures/gpt2_tiny_reference.safetensors``, which
``models/gpt2/tests/reference_pytorch.rs`` compares the Rust reference model
(``src/reference.rs``) against, and ``gpt2_tiny_reference_bf16.safetensors``,
the same model in bf16 mixed precision (see "The bf16 fixture" below), which
``models/gpt2/tests/reference_pytorch_bf16.rs`` compares the bf16 model with.

and ``gpt2_tiny_decode.safetensors``, a greedy continuation by Hugging Face
of a prompt with the fp32 fixture's initial parameters (see "The decode
fixture" below), which ``models/gpt2/tests/reference_pytorch.rs`` holds
the sampler's KV-cache decoding to.

Re-run (from anywhere; the output paths are found relative to this file):

    pip install torch transformers safetensors numpy
    python3 models/gpt2/scripts/make_reference.py [--only fp32|bf16|decode]

(``decode`` reads the fp32 fixture's parameters rather than drawing them:
it needs no particular torch version to match.)

What a re-run reproduces
------------------------
Two runs on one machine with the same versions write the same files, bit for
bit (the metadata's keys are written sorted: safetensors' own order changes
from run to run). Against the committed fixtures, which were written before
the keys were sorted (their headers list them in another order) and record
their versions in their metadata (``torch_version``, ``transformers_version``:
the fp32 fixture torch 2.15.0+cu132 and transformers 5.23.0, the bf16 and
decode fixtures torch 2.15.0+cu132 and transformers 5.24.0), a re-run with
torch 2.15.0 and transformers 5.24.0 on another CPU gave:

- fp32: the same initial parameters, tokens, targets, logits and loss, bit
  for bit; gradients within 3e-7 of each tensor's largest (another
  transformers version sums in another order); step losses within 5e-7,
  final parameters within 3e-6.
- bf16: the same initial parameters and loss; logits and gradients one bf16
  rounding step apart in places, and step losses up to 2e-4 apart (another
  CPU kernel path rounds differently). The tests' tolerances cover both.
- decode: the same tensors, bit for bit.

So a re-run is not expected to leave the committed files unchanged; commit
new fixtures only when the model or the recipe changes.

What it does
------------
1. Builds Hugging Face ``GPT2LMHeadModel`` for the ``tiny`` config of
   ``src/config.rs`` (n_positions 64, vocab 512, 2 layers, 4 heads, 64
   channels), tanh GELU (``gelu_new``), layer-norm epsilon 1e-5, no dropout,
   eager attention, float32, seeded. HF initialises biases to 0 and layer-norm
   weights to 1; the script then perturbs every bias and layer-norm parameter
   with small noise, so a kernel that ignores a bias or a gain cannot pass.
2. Draws fixed ``tokens`` and ``targets`` (B=2, T=16). The targets are drawn
   independently: the loss is ``F.cross_entropy(logits.view(-1, V),
   targets.view(-1))``, the mean over all B*T positions. (HF's own ``labels=``
   path shifts labels by one; it is not used.)
3. One forward and backward: records ``logits`` (B,T,V), ``loss`` and the
   gradient of every parameter.
4. From the same initial parameters, 5 optimizer steps on that same batch:
   each step zeroes the gradients, runs forward and backward, clips the global
   gradient L2 norm to ``max_grad_norm`` with ``clip_grad_norm_`` (which
   engages: the norms are above it), then takes a ``torch.optim.AdamW`` step
   (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 applied to ALL
   parameters, as llm.c does and as braid's ``adamw_update`` does when called
   on the whole flat buffer). Records each step's loss (before its update) and
   pre-clipping gradient norm, and the parameters after the last step for every
   1-D tensor and for ``transformer.h.0.attn.c_attn.weight``.

Fixture contents (all float32 unless noted; names are HF's)
-----------------------------------------------------------
- ``<hf name>``          initial parameters as HF stores them: Conv1D weights
                         (``c_attn``, ``c_proj``, ``c_fc``, ``mlp.c_proj``) are
                         (in, out). ``lm_head.weight`` is tied to
                         ``transformer.wte.weight`` and stored once, as the latter.
- ``grad.<hf name>``     gradient of the mean loss, same shape as the parameter.
- ``final.<hf name>``    parameters after the 5 AdamW steps (subset, see above).
- ``tokens``, ``targets`` int32 (B, T).
- ``logits``             (B, T, V).
- ``loss``               (1,) mean cross-entropy.
- ``step_losses``        (5,) loss at each optimizer step, before its update.
- ``step_grad_norms``    (5,) global gradient L2 norm before clipping.
- metadata               config, batch shape, seed, optimizer settings, versions.

The bf16 fixture
----------------
llm.c's mixed precision, which braid's ``--dtype bf16`` follows: bf16
parameters, activations and gradients, fp32 master weights and AdamW moments,
fp32 arithmetic inside every kernel. In PyTorch: the same initial (fp32)
parameters are the master weights; a copy of the model converted with
``.to(torch.bfloat16)`` runs forward and backward (PyTorch's CPU kernels for
bf16 tensors compute in fp32 and round their outputs: matmuls accumulate in
fp32, layer norm and softmax reduce in fp32). ``torch.autocast`` is not used:
it keeps layer norms, the residual stream and the parameter gradients in
fp32, which is not what llm.c (or braid) stores. Details:

- GELU is ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``, one kernel,
  rounded once), the same function as ``gelu_new``, whose chain of bf16
  elementwise ops would round after each.
- The loss is ``F.cross_entropy(logits.float(), ...)``: the logits are bf16,
  the log-softmax and the mean are fp32 (braid computes each position's loss
  from its fp32 softmax of the bf16 logits). The logits' gradient is rounded
  to bf16 where it flows back into the bf16 graph.
- The AdamW steps: per step, the bf16 model's parameters are the master
  weights rounded (round to nearest even); forward and backward in bf16;
  the bf16 gradients, as fp32, become the master weights' gradients;
  ``clip_grad_norm_`` and ``torch.optim.AdamW`` (same settings) on the fp32
  master weights.

It holds the same tensors as the fp32 fixture (bf16 values stored as F32,
exactly), ``final.<hf name>`` being the fp32 master weights after the steps.

The decode fixture
------------------
The fp32 fixture's initial parameters loaded into ``GPT2LMHeadModel``,
every 2-D weight (``wte``, ``wpe`` and the four matrices of each block)
multiplied by ``DECODE_SCALE`` (8, exact in float32): at the
initialisation's scale the logits are so flat that the greedy tokens
repeat one id and ignore their context, and a sampler whose window is
one short, or never slides, would draw the same; the script checks that
both of those would not. A prompt of the first ``DECODE_PROMPT`` of the
fixture's tokens; then
``DECODE_TOKENS`` greedy tokens, each the argmax of the last row of a
forward pass over the sequence's last ``n_positions`` (64) tokens, the
window sliding once full, as braid's sampler does (so both the KV-cache
phase and the sliding phase are covered). Tensors: ``prompt`` and
``tokens`` (int32), ``logits`` (DECODE_TOKENS, V): the logits each token
was chosen from, ``margins`` (DECODE_TOKENS,): the gap between the largest
and second-largest logit, all above ``MIN_MARGIN`` (checked), so the
choices are not ties that float rounding could flip.
"""

import argparse
import copy
import json
import os
import struct

import torch
import torch.nn.functional as F
import safetensors.torch
from transformers import GPT2Config, GPT2LMHeadModel

SEED = 1337
B, T = 2, 16
CONFIG = dict(n_positions=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64)
STEPS = 5
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.95, 1e-8, 0.1
MAX_GRAD_NORM = 1.0
# Noise added to the parameters HF initialises to constants.
BIAS_STD, LN_WEIGHT_STD = 0.02, 0.1
# Final parameters kept beyond the 1-D ones.
FINAL_MATRICES = ["transformer.h.0.attn.c_attn.weight"]

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "gpt2_tiny_reference.safetensors")
OUT_BF16 = os.path.join(FIXTURES, "gpt2_tiny_reference_bf16.safetensors")
OUT_DECODE = os.path.join(FIXTURES, "gpt2_tiny_decode.safetensors")

DECODE_PROMPT, DECODE_TOKENS, MIN_MARGIN, DECODE_SCALE = 5, 80, 1e-3, 8.0


def save_file(tensors, path, metadata) -> None:
    """``safetensors.torch.save_file`` with the metadata's keys sorted.

    safetensors keeps the metadata in a hash map whose order changes from run
    to run, so the same fixture came out with its header's keys in another
    order each time: the header is rewritten with the keys sorted (the same
    bytes, reordered; the tensors' entries and data are left as they are).
    """
    data = safetensors.torch.save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # The same bytes reordered: the original's length up to its padding.
    assert len(text) <= n and not data[8 + len(text) : 8 + n].strip(), "re-encoded differently"
    text += b" " * (n - len(text))
    with open(path, "wb") as f:
        f.write(data[:8] + text + data[8 + n :])


def build_model(activation: str = "gelu_new") -> GPT2LMHeadModel:
    config = GPT2Config(
        **CONFIG,
        activation_function=activation,
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,  # HF defaults to 50256, outside this vocabulary; unused
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(BIAS_STD * torch.randn(p.shape, generator=gen))
            elif ".ln_" in name:  # layer-norm weights (ln_1, ln_2, ln_f)
                p.add_(LN_WEIGHT_STD * torch.randn(p.shape, generator=gen))
    assert model.lm_head.weight is model.transformer.wte.weight, "wte must be tied"
    return model.float()


def mean_loss(model, tokens, targets):
    logits = model(tokens).logits
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    return logits, loss


def make_fp32() -> None:
    model = build_model()
    model.train()  # dropout is 0, so train and eval agree
    gen = torch.Generator().manual_seed(SEED + 2)
    tokens = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen)
    targets = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen)

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = {n: t.contiguous() for n, t in initial.items()}

    # 1. forward and backward
    logits, loss = mean_loss(model, tokens, targets)
    loss.backward()
    for n, p in model.named_parameters():
        tensors[f"grad.{n}"] = p.grad.detach().clone().contiguous()
    tensors["logits"] = logits.detach().contiguous()
    tensors["loss"] = loss.detach().reshape(1)
    tensors["tokens"] = tokens.to(torch.int32).contiguous()
    tensors["targets"] = targets.to(torch.int32).contiguous()

    # 2. optimizer steps from the same initial parameters
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        betas=(BETA1, BETA2),
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
    )
    step_losses, step_norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _, loss = mean_loss(model, tokens, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        step_losses.append(loss.item())
        step_norms.append(norm.item())
    for n, p in model.named_parameters():
        if p.dim() == 1 or n in FINAL_MATRICES:
            tensors[f"final.{n}"] = p.detach().clone().contiguous()
    tensors["step_losses"] = torch.tensor(step_losses, dtype=torch.float32)
    tensors["step_grad_norms"] = torch.tensor(step_norms, dtype=torch.float32)
    assert min(step_norms) > MAX_GRAD_NORM, "clipping must engage to be tested"

    metadata = common_metadata()
    metadata["gelu"] = "tanh approximation (gelu_new)"
    save(tensors, OUT, metadata, step_losses, step_norms)


def common_metadata() -> dict:
    return {
        "config": json.dumps(
            dict(
                max_seq_len=CONFIG["n_positions"],
                vocab_size=CONFIG["vocab_size"],
                num_layers=CONFIG["n_layer"],
                num_heads=CONFIG["n_head"],
                channels=CONFIG["n_embd"],
            )
        ),
        "batch_size": str(B),
        "seq_len": str(T),
        "seed": str(SEED),
        "steps": str(STEPS),
        "lr": repr(LR),
        "beta1": repr(BETA1),
        "beta2": repr(BETA2),
        "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY),
        "weight_decay_applies_to": "all parameters",
        "max_grad_norm": repr(MAX_GRAD_NORM),
        "loss": "mean cross-entropy over B*T positions, targets not shifted",
        "layer_norm_epsilon": "1e-05",
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "generator": "models/gpt2/scripts/make_reference.py",
    }


def save(tensors, out, metadata, step_losses, step_norms) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file(tensors, out, metadata=metadata)
    print(f"wrote {os.path.normpath(out)}: {os.path.getsize(out)} bytes, {len(tensors)} tensors")
    print(f"loss {tensors['loss'].item():.6f}")
    print("step losses", " ".join(f"{x:.6f}" for x in step_losses))
    print("grad norms ", " ".join(f"{x:.6f}" for x in step_norms))


def bf16_loss(model_bf16, tokens, targets):
    """bf16 logits; fp32 log-softmax and mean (module docs)."""
    logits = model_bf16(tokens).logits
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    return logits, loss


def make_bf16() -> None:
    master_model = build_model("gelu_pytorch_tanh")  # fp32: the master weights
    gen = torch.Generator().manual_seed(SEED + 2)
    tokens = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen)
    targets = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen)
    initial = {n: p.detach().clone() for n, p in master_model.named_parameters()}
    tensors = {n: t.contiguous() for n, t in initial.items()}

    model = copy.deepcopy(master_model).to(torch.bfloat16)
    model.train()
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())

    # 1. forward and backward in bf16
    logits, loss = bf16_loss(model, tokens, targets)
    loss.backward()
    for n, p in params.items():
        assert p.grad.dtype == torch.bfloat16
        tensors[f"grad.{n}"] = p.grad.detach().float().contiguous()
    tensors["logits"] = logits.detach().float().contiguous()
    tensors["loss"] = loss.detach().float().reshape(1)
    tensors["tokens"] = tokens.to(torch.int32).contiguous()
    tensors["targets"] = targets.to(torch.int32).contiguous()

    # 2. AdamW steps on fp32 master weights, forward/backward in bf16
    master = {n: initial[n].clone().requires_grad_(True) for n in params}
    opt = torch.optim.AdamW(
        list(master.values()),
        lr=LR,
        betas=(BETA1, BETA2),
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
    )
    step_losses, step_norms = [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(master[n].detach().to(torch.bfloat16))
        _, loss = bf16_loss(model, tokens, targets)
        loss.backward()
        for n, p in params.items():
            master[n].grad = p.grad.detach().float()
        norm = torch.nn.utils.clip_grad_norm_(list(master.values()), MAX_GRAD_NORM)
        opt.step()
        step_losses.append(loss.item())
        step_norms.append(norm.item())
    for n, p in master.items():
        if p.dim() == 1 or n in FINAL_MATRICES:
            tensors[f"final.{n}"] = p.detach().clone().contiguous()
    tensors["step_losses"] = torch.tensor(step_losses, dtype=torch.float32)
    tensors["step_grad_norms"] = torch.tensor(step_norms, dtype=torch.float32)
    assert min(step_norms) > MAX_GRAD_NORM, "clipping must engage to be tested"

    metadata = common_metadata()
    metadata["gelu"] = "tanh approximation (gelu_pytorch_tanh)"
    metadata["dtype"] = "bf16 parameters, activations and gradients; fp32 master weights"
    save(tensors, OUT_BF16, metadata, step_losses, step_norms)


def make_decode() -> None:
    from safetensors.torch import load_file

    fixture = load_file(OUT)
    model = build_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(fixture[n] * (DECODE_SCALE if p.dim() == 2 else 1.0))
    model.eval()
    prompt = fixture["tokens"][0, :DECODE_PROMPT].long().tolist()

    def greedy(window_of):
        seq, chosen, rows, margins = list(prompt), [], [], []
        with torch.no_grad():
            for _ in range(DECODE_TOKENS):
                row = model(torch.tensor([window_of(seq)])).logits[0, -1]
                top2 = torch.topk(row, 2).values
                margins.append((top2[0] - top2[1]).item())
                nxt = int(torch.argmax(row))
                chosen.append(nxt)
                rows.append(row.clone())
                seq.append(nxt)
        return seq, chosen, rows, margins

    n = CONFIG["n_positions"]
    seq, chosen, rows, margins = greedy(lambda s: s[-n:])
    assert min(margins) > MIN_MARGIN, f"a near tie: {min(margins)}"
    assert len(seq) > n, "the window must slide"
    # The tokens tell a right sampler from a window one short or stuck.
    assert greedy(lambda s: s[-(n - 1) :])[1] != chosen, "a short window draws the same"
    assert greedy(lambda s: s[:n])[1] != chosen, "a stuck window draws the same"
    tensors = {
        "prompt": torch.tensor(prompt, dtype=torch.int32),
        "tokens": torch.tensor(chosen, dtype=torch.int32),
        "logits": torch.stack(rows).contiguous(),
        "margins": torch.tensor(margins, dtype=torch.float32),
    }
    metadata = common_metadata()
    metadata["decode"] = (
        f"greedy, prompt of {DECODE_PROMPT} tokens, {DECODE_TOKENS} tokens, "
        f"window of {CONFIG['n_positions']} sliding once full, 2-D weights "
        f"of the fp32 fixture times {DECODE_SCALE}"
    )
    save_file(tensors, OUT_DECODE, metadata=metadata)
    print(f"wrote {os.path.normpath(OUT_DECODE)}: {os.path.getsize(OUT_DECODE)} bytes")
    print("tokens", chosen)
    print(f"smallest margin {min(margins):.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", choices=["fp32", "bf16", "decode"], help="make one fixture"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # reproducible reductions
    if args.only in (None, "fp32"):
        make_fp32()
    if args.only in (None, "bf16"):
        make_bf16()
    if args.only in (None, "decode"):
        make_decode()


if __name__ == "__main__":
    main()
