#!/usr/bin/env python3
"""Make the PyTorch reference fixture for braid-gpt2's CPU model.

Writes ``models/gpt2/tests/fixtures/gpt2_tiny_reference.safetensors``, which
``models/gpt2/tests/reference_pytorch.rs`` compares the Rust reference model
(``src/reference.rs``) against.

Re-run (from anywhere; the output path is found relative to this file):

    pip install torch transformers safetensors numpy
    python3 models/gpt2/scripts/make_reference.py

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
"""

import copy
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
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

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "tests",
    "fixtures",
    "gpt2_tiny_reference.safetensors",
)


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        **CONFIG,
        activation_function="gelu_new",
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


def main() -> None:
    torch.set_num_threads(1)  # reproducible reductions
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

    metadata = {
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
        "gelu": "tanh approximation (gelu_new)",
        "layer_norm_epsilon": "1e-05",
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "generator": "models/gpt2/scripts/make_reference.py",
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file(tensors, OUT, metadata=metadata)
    print(f"wrote {os.path.normpath(OUT)}: {os.path.getsize(OUT)} bytes, {len(tensors)} tensors")
    print(f"loss {tensors['loss'].item():.6f}")
    print("step losses", " ".join(f"{x:.6f}" for x in step_losses))
    print("grad norms ", " ".join(f"{x:.6f}" for x in step_norms))


if __name__ == "__main__":
    main()
