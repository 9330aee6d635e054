//! Kernel launches as task bodies: the one seam between the task graph and
//! the device.
//!
//! Every kernel the model and the optimizer run is an [`Op`]: the kernel with
//! its views and sizes. [`Op::accesses`] derives the task's declared accesses
//! from the op alone, so the task graph is the same on every backend by
//! construction; [`Op::run`] is the task body, and the only place that looks at
//! the device:
//!
//! * `DeviceCtx::Cpu` borrows the declared host slices from the task context
//!   and calls the kernels of [`crate::kernels::cpu`];
//! * `DeviceCtx::Cuda` calls the launcher of [`crate::kernels::cuda`] with the
//!   same views (each launcher resolves them to device addresses through the
//!   task's declared accesses and queues its kernels and cuBLAS products on
//!   the task's stream); zeroing is a `cuMemsetD8Async` on that stream.
//!
//! The ops are cut the way the GPU launchers are (softmax and cross-entropy in
//! one task, a scratch view for attention and for the norm's partial sums, the
//! clip factor applied as AdamW reads the gradients), so each op is one
//! launcher call. The CPU kernels take one `(N, C)` matrix where the launchers
//! take `(B, T, C)`: ops of `n = B·T` rows call them with `B = 1, T = n`, the
//! same memory. A task that lands on a device without an arm (a backend added
//! to the engine later) fails with [`braid::Error::BackendUnavailable`] at the
//! next synchronisation point (no panic, no hang).
//!
//! # Token ids on the GPU
//!
//! Three launchers index memory with ids read on the device
//! (`encoder_forward`, `encoder_backward`, `softmax_crossentropy_forward`) and
//! are `unsafe`: every id must be below the vocabulary size. The views they
//! get here are the model's private `tokens` and `targets` buffers, which are
//! zero when allocated and written only by `Gpt2Model::forward`, after it
//! checked every id against the vocabulary on the host
//! (`crate::data::check_ids`, the check of [`crate::kernels::check_tokens`]);
//! `V` is the configuration's vocabulary, the row count of `wte` and of every
//! probability row.

use std::borrow::Cow;

use braid::{
    CudaTaskCtx, DeviceCtx, Mode, Priority, Runtime, TaskCtx, TaskError, TaskHandle, View,
};

use crate::kernels::cpu as k;
use crate::kernels::cuda as gk;

/// The backends (by [`Runtime::backend_name`]) whose kernels `Op::run`
/// dispatches to. A backend is added here together with its arm in `run`.
pub const KERNEL_BACKENDS: &[&str] = &["cpu", "cuda"];

/// One kernel launch: the kernel, the views it touches, and its sizes.
///
/// Shapes follow [`crate::kernels::cpu`]: `n = B·T` rows, `c` input channels,
/// `oc` output channels, `v` vocabulary.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    /// `out = wte[tokens] + wpe[:T]`.
    Encoder {
        out: View,    // (B, T, C)
        tokens: View, // (B, T) u32
        wte: View,    // (V, C)
        wpe: View,    // (T, C): only the rows used
        b: usize,
        t: usize,
        c: usize,
    },
    /// `dwte[tokens] += dout; dwpe += dout`.
    EncoderBackward {
        dwte: View,   // (V, C)
        dwpe: View,   // (T, C)
        dout: View,   // (B, T, C)
        tokens: View, // (B, T) u32
        b: usize,
        t: usize,
        c: usize,
    },
    LayerNorm {
        out: View,    // (B, T, C)
        mean: View,   // (B, T)
        rstd: View,   // (B, T)
        inp: View,    // (B, T, C)
        weight: View, // (C)
        bias: View,   // (C)
        n: usize,
        c: usize,
    },
    LayerNormBackward {
        dinp: View,    // (B, T, C) accumulated
        dweight: View, // (C) accumulated
        dbias: View,   // (C) accumulated
        dout: View,    // (B, T, C)
        inp: View,     // (B, T, C)
        weight: View,  // (C)
        mean: View,    // (B, T)
        rstd: View,    // (B, T)
        n: usize,
        c: usize,
    },
    /// `out = inp · weightᵀ + bias`.
    Matmul {
        out: View,          // (B, T, OC)
        inp: View,          // (B, T, C)
        weight: View,       // (OC, C)
        bias: Option<View>, // (OC)
        n: usize,
        c: usize,
        oc: usize,
    },
    /// `dinp += dout · weight` (the critical path).
    MatmulBackwardInput {
        dinp: View,   // (B, T, C) accumulated
        dout: View,   // (B, T, OC)
        weight: View, // (OC, C)
        n: usize,
        c: usize,
        oc: usize,
    },
    /// `dweight += doutᵀ · inp; dbias += Σ dout` (off the critical path).
    MatmulBackwardWeight {
        dweight: View,       // (OC, C) accumulated
        dbias: Option<View>, // (OC) accumulated
        dout: View,          // (B, T, OC)
        inp: View,           // (B, T, C)
        n: usize,
        c: usize,
        oc: usize,
    },
    Attention {
        out: View,     // (B, T, C)
        preatt: View,  // (B, NH, T, T)
        att: View,     // (B, NH, T, T)
        inp: View,     // (B, T, 3C)
        scratch: View, // device scratch (unused on the CPU)
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    },
    AttentionBackward {
        dinp: View,    // (B, T, 3C) accumulated
        dout: View,    // (B, T, C)
        inp: View,     // (B, T, 3C)
        att: View,     // (B, NH, T, T)
        scratch: View, // device scratch (unused on the CPU)
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    },
    Gelu {
        out: View, // (N)
        inp: View, // (N)
    },
    GeluBackward {
        dinp: View, // (N) accumulated
        inp: View,  // (N)
        dout: View, // (N)
    },
    /// `out = a + b`.
    Residual {
        out: View, // (N)
        a: View,   // (N)
        b: View,   // (N)
    },
    /// `da += dout; db += dout`.
    ResidualBackward {
        da: View,   // (N) accumulated
        db: View,   // (N) accumulated
        dout: View, // (N)
    },
    Softmax {
        probs: View,  // (B, T, V)
        logits: View, // (B, T, V)
        n: usize,
        v: usize,
    },
    /// `probs = softmax(logits); losses = -ln probs[targets]` (one task,
    /// the two CPU kernels in turn; one fused kernel on a GPU).
    SoftmaxCrossEntropy {
        probs: View,   // (B, T, V)
        losses: View,  // (B, T)
        logits: View,  // (B, T, V)
        targets: View, // (B, T) u32
        n: usize,
        v: usize,
    },
    /// `loss[0] = mean(losses)` (f64 accumulation, as the reference).
    MeanLoss {
        loss: View,   // (1)
        losses: View, // (B, T)
    },
    CrossEntropySoftmaxBackward {
        dlogits: View, // (B, T, V) accumulated
        probs: View,   // (B, T, V)
        targets: View, // (B, T) u32
        dloss: f32,
        n: usize,
        v: usize,
    },
    /// `out = 0`.
    Zero {
        out: View, // (N) any element type
    },
    /// `partial[0] = Σ grads²` in f64.
    SumSquares {
        partial: View, // (1) f64
        scratch: View, // (P) f64 device scratch (unused on the CPU)
        grads: View,   // (N)
    },
    /// `scale[0] = min(1, max_norm / (sqrt(Σ partials) + 1e-6))`, the
    /// partials summed in chunk order.
    ClipScale {
        scale: View,    // (1) f32
        partials: View, // (chunks) f64
        max_norm: f32,
    },
    /// One AdamW step on a chunk of parameters and moments, with the
    /// gradients multiplied by the clip factor as they are read (`grads` is
    /// not modified).
    AdamW {
        params: View,        // (N)
        grads: View,         // (N)
        m: View,             // (N)
        v: View,             // (N)
        scale: Option<View>, // (1) f32 from ClipScale
        step: u64,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

use Mode::{Read as R, ReadWrite as RW, Write as W};

impl Op {
    /// The accesses the task declares: exactly the views the kernel touches,
    /// in the mode it touches them (forward outputs are overwritten, backward
    /// outputs accumulated).
    pub(crate) fn accesses(&self) -> Vec<(View, Mode)> {
        let a = |v: &View, m: Mode| (v.clone(), m);
        match self {
            Op::Encoder {
                out,
                tokens,
                wte,
                wpe,
                ..
            } => vec![a(out, W), a(tokens, R), a(wte, R), a(wpe, R)],
            Op::EncoderBackward {
                dwte,
                dwpe,
                dout,
                tokens,
                ..
            } => vec![a(dwte, RW), a(dwpe, RW), a(dout, R), a(tokens, R)],
            Op::LayerNorm {
                out,
                mean,
                rstd,
                inp,
                weight,
                bias,
                ..
            } => vec![
                a(out, W),
                a(mean, W),
                a(rstd, W),
                a(inp, R),
                a(weight, R),
                a(bias, R),
            ],
            Op::LayerNormBackward {
                dinp,
                dweight,
                dbias,
                dout,
                inp,
                weight,
                mean,
                rstd,
                ..
            } => vec![
                a(dinp, RW),
                a(dweight, RW),
                a(dbias, RW),
                a(dout, R),
                a(inp, R),
                a(weight, R),
                a(mean, R),
                a(rstd, R),
            ],
            Op::Matmul {
                out,
                inp,
                weight,
                bias,
                ..
            } => {
                let mut v = vec![a(out, W), a(inp, R), a(weight, R)];
                v.extend(bias.iter().map(|b| a(b, R)));
                v
            }
            Op::MatmulBackwardInput {
                dinp, dout, weight, ..
            } => vec![a(dinp, RW), a(dout, R), a(weight, R)],
            Op::MatmulBackwardWeight {
                dweight,
                dbias,
                dout,
                inp,
                ..
            } => {
                let mut v = vec![a(dweight, RW)];
                v.extend(dbias.iter().map(|b| a(b, RW)));
                v.extend([a(dout, R), a(inp, R)]);
                v
            }
            Op::Attention {
                out,
                preatt,
                att,
                inp,
                scratch,
                ..
            } => vec![a(out, W), a(preatt, W), a(att, W), a(inp, R), a(scratch, W)],
            Op::AttentionBackward {
                dinp,
                dout,
                inp,
                att,
                scratch,
                ..
            } => vec![a(dinp, RW), a(dout, R), a(inp, R), a(att, R), a(scratch, W)],
            Op::Gelu { out, inp } => vec![a(out, W), a(inp, R)],
            Op::GeluBackward { dinp, inp, dout } => vec![a(dinp, RW), a(inp, R), a(dout, R)],
            Op::Residual { out, a: x, b: y } => vec![a(out, W), a(x, R), a(y, R)],
            Op::ResidualBackward { da, db, dout } => vec![a(da, RW), a(db, RW), a(dout, R)],
            Op::Softmax { probs, logits, .. } => vec![a(probs, W), a(logits, R)],
            Op::SoftmaxCrossEntropy {
                probs,
                losses,
                logits,
                targets,
                ..
            } => vec![a(probs, W), a(losses, W), a(logits, R), a(targets, R)],
            Op::MeanLoss { loss, losses } => vec![a(loss, W), a(losses, R)],
            Op::CrossEntropySoftmaxBackward {
                dlogits,
                probs,
                targets,
                ..
            } => vec![a(dlogits, RW), a(probs, R), a(targets, R)],
            Op::Zero { out } => vec![a(out, W)],
            Op::SumSquares {
                partial,
                scratch,
                grads,
            } => vec![a(partial, W), a(scratch, W), a(grads, R)],
            Op::ClipScale {
                scale, partials, ..
            } => vec![a(scale, W), a(partials, R)],
            Op::AdamW {
                params,
                grads,
                m,
                v,
                scale,
                ..
            } => {
                let mut out = vec![a(params, RW), a(grads, R), a(m, RW), a(v, RW)];
                out.extend(scale.iter().map(|s| a(s, R)));
                out
            }
        }
    }

    /// The task body: dispatches on the device the task runs on.
    pub(crate) fn run(&self, ctx: &TaskCtx<'_>) -> Result<(), TaskError> {
        match ctx.device() {
            DeviceCtx::Cpu(_) => self.run_cpu(ctx),
            DeviceCtx::Cuda(cu) => self.run_cuda(ctx, cu),
            _ => Err(Box::new(braid::Error::BackendUnavailable {
                backend: "unknown",
                reason: format!(
                    "task `{}`: the GPT-2 kernels run on {KERNEL_BACKENDS:?} only",
                    ctx.name()
                ),
            })),
        }
    }

    /// The CPU backend: host slices of the declared views, and the kernels of
    /// [`crate::kernels::cpu`].
    fn run_cpu(&self, ctx: &TaskCtx<'_>) -> Result<(), TaskError> {
        match self {
            Op::Encoder {
                out,
                tokens,
                wte,
                wpe,
                b,
                t,
                c,
            } => k::encoder_forward(
                ctx.write(out)?,
                ctx.read(tokens)?,
                ctx.read(wte)?,
                ctx.read(wpe)?,
                *b,
                *t,
                *c,
            ),
            Op::EncoderBackward {
                dwte,
                dwpe,
                dout,
                tokens,
                b,
                t,
                c,
            } => k::encoder_backward(
                ctx.write(dwte)?,
                ctx.write(dwpe)?,
                ctx.read(dout)?,
                ctx.read(tokens)?,
                *b,
                *t,
                *c,
            ),
            Op::LayerNorm {
                out,
                mean,
                rstd,
                inp,
                weight,
                bias,
                n,
                c,
            } => k::layernorm_forward(
                ctx.write(out)?,
                ctx.write(mean)?,
                ctx.write(rstd)?,
                ctx.read(inp)?,
                ctx.read(weight)?,
                ctx.read(bias)?,
                1,
                *n,
                *c,
            ),
            Op::LayerNormBackward {
                dinp,
                dweight,
                dbias,
                dout,
                inp,
                weight,
                mean,
                rstd,
                n,
                c,
            } => k::layernorm_backward(
                ctx.write(dinp)?,
                ctx.write(dweight)?,
                ctx.write(dbias)?,
                ctx.read(dout)?,
                ctx.read(inp)?,
                ctx.read(weight)?,
                ctx.read(mean)?,
                ctx.read(rstd)?,
                1,
                *n,
                *c,
            ),
            Op::Matmul {
                out,
                inp,
                weight,
                bias,
                n,
                c,
                oc,
            } => {
                let bias = match bias {
                    Some(b) => Some(ctx.read(b)?),
                    None => None,
                };
                k::matmul_forward(
                    ctx.write(out)?,
                    ctx.read(inp)?,
                    ctx.read(weight)?,
                    bias,
                    1,
                    *n,
                    *c,
                    *oc,
                )
            }
            Op::MatmulBackwardInput {
                dinp,
                dout,
                weight,
                n,
                c,
                oc,
            } => k::matmul_backward_input(
                ctx.write(dinp)?,
                ctx.read(dout)?,
                ctx.read(weight)?,
                1,
                *n,
                *c,
                *oc,
            ),
            Op::MatmulBackwardWeight {
                dweight,
                dbias,
                dout,
                inp,
                n,
                c,
                oc,
            } => {
                let dbias = match dbias {
                    Some(b) => Some(ctx.write(b)?),
                    None => None,
                };
                k::matmul_backward_weight(
                    ctx.write(dweight)?,
                    dbias,
                    ctx.read(dout)?,
                    ctx.read(inp)?,
                    1,
                    *n,
                    *c,
                    *oc,
                )
            }
            Op::Attention {
                out,
                preatt,
                att,
                inp,
                scratch: _,
                b,
                t,
                c,
                nh,
            } => k::attention_forward(
                ctx.write(out)?,
                ctx.write(preatt)?,
                ctx.write(att)?,
                ctx.read(inp)?,
                *b,
                *t,
                *c,
                *nh,
            ),
            Op::AttentionBackward {
                dinp,
                dout,
                inp,
                att,
                scratch: _,
                b,
                t,
                c,
                nh,
            } => k::attention_backward(
                ctx.write(dinp)?,
                ctx.read(dout)?,
                ctx.read(inp)?,
                ctx.read(att)?,
                *b,
                *t,
                *c,
                *nh,
            ),
            Op::Gelu { out, inp } => k::gelu_forward(ctx.write(out)?, ctx.read(inp)?),
            Op::GeluBackward { dinp, inp, dout } => {
                k::gelu_backward(ctx.write(dinp)?, ctx.read(inp)?, ctx.read(dout)?)
            }
            Op::Residual { out, a, b } => {
                k::residual_forward(ctx.write(out)?, ctx.read(a)?, ctx.read(b)?)
            }
            Op::ResidualBackward { da, db, dout } => {
                k::residual_backward(ctx.write(da)?, ctx.write(db)?, ctx.read(dout)?)
            }
            Op::Softmax {
                probs,
                logits,
                n,
                v,
            } => k::softmax_forward(ctx.write(probs)?, ctx.read(logits)?, 1, *n, *v),
            Op::SoftmaxCrossEntropy {
                probs,
                losses,
                logits,
                targets,
                n,
                v,
            } => {
                let p = ctx.write(probs)?;
                k::softmax_forward(p, ctx.read(logits)?, 1, *n, *v);
                k::crossentropy_forward(ctx.write(losses)?, p, ctx.read(targets)?, 1, *n, *v);
            }
            Op::MeanLoss { loss, losses } => {
                ctx.write::<f32>(loss)?[0] = k::mean_loss(ctx.read(losses)?);
            }
            Op::CrossEntropySoftmaxBackward {
                dlogits,
                probs,
                targets,
                dloss,
                n,
                v,
            } => k::crossentropy_softmax_backward(
                ctx.write(dlogits)?,
                ctx.read(probs)?,
                ctx.read(targets)?,
                *dloss,
                1,
                *n,
                *v,
            ),
            Op::Zero { out } => ctx.write::<u8>(out)?.fill(0),
            Op::SumSquares {
                partial,
                scratch: _,
                grads,
            } => {
                ctx.write::<f64>(partial)?[0] = k::grad_norm_sq(ctx.read(grads)?);
            }
            Op::ClipScale {
                scale,
                partials,
                max_norm,
            } => {
                let norm = global_norm(ctx.read::<f64>(partials)?);
                ctx.write::<f32>(scale)?[0] = k::clip_scale(norm, *max_norm);
            }
            Op::AdamW {
                params,
                grads,
                m,
                v,
                scale,
                step,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let g = ctx.read::<f32>(grads)?;
                // The clip factor applied as the gradients are read: the same
                // products `scale_in_place` forms, into a copy.
                let scaled: Vec<f32>;
                let g = match scale {
                    Some(s) if ctx.read::<f32>(s)?[0] != 1.0 => {
                        let s = ctx.read::<f32>(s)?[0];
                        scaled = g.iter().map(|x| x * s).collect();
                        &scaled[..]
                    }
                    _ => g,
                };
                k::adamw_update(
                    ctx.write(params)?,
                    g,
                    ctx.write(m)?,
                    ctx.write(v)?,
                    *step,
                    *lr,
                    *beta1,
                    *beta2,
                    *eps,
                    *weight_decay,
                );
            }
        }
        Ok(())
    }
}

impl Op {
    /// The CUDA backend: the launchers of [`crate::kernels::cuda`] on the same
    /// views, queued on the task's stream (`cu`). Launchers check every view
    /// against its shape, its declaration and its mode before queuing
    /// anything, so a mismatch is an error of this task, never a bad access.
    fn run_cuda(&self, ctx: &TaskCtx<'_>, cu: &CudaTaskCtx<'_>) -> Result<(), TaskError> {
        match self {
            Op::Encoder {
                out,
                tokens,
                wte,
                wpe,
                b,
                t,
                c,
            } => {
                // SAFETY: `tokens` is the model's token buffer, whose ids were
                // all checked to be below the vocabulary size (the rows of
                // `wte`) on the host before they were uploaded (module docs).
                unsafe { gk::encoder_forward(ctx, out, tokens, wte, wpe, *b, *t, *c) }?
            }
            Op::EncoderBackward {
                dwte,
                dwpe,
                dout,
                tokens,
                b,
                t,
                c,
            } => {
                // SAFETY: as for `Op::Encoder`: the same checked token buffer,
                // `dwte` has the vocabulary's rows.
                unsafe { gk::encoder_backward(ctx, dwte, dwpe, dout, tokens, *b, *t, *c) }?
            }
            Op::LayerNorm {
                out,
                mean,
                rstd,
                inp,
                weight,
                bias,
                n,
                c,
            } => gk::layernorm_forward(ctx, out, mean, rstd, inp, weight, bias, 1, *n, *c)?,
            Op::LayerNormBackward {
                dinp,
                dweight,
                dbias,
                dout,
                inp,
                weight,
                mean,
                rstd,
                n,
                c,
            } => gk::layernorm_backward(
                ctx, dinp, dweight, dbias, dout, inp, weight, mean, rstd, 1, *n, *c,
            )?,
            Op::Matmul {
                out,
                inp,
                weight,
                bias,
                n,
                c,
                oc,
            } => gk::matmul_forward(ctx, out, inp, weight, bias.as_ref(), 1, *n, *c, *oc)?,
            Op::MatmulBackwardInput {
                dinp,
                dout,
                weight,
                n,
                c,
                oc,
            } => gk::matmul_backward_input(ctx, dinp, dout, weight, 1, *n, *c, *oc)?,
            Op::MatmulBackwardWeight {
                dweight,
                dbias,
                dout,
                inp,
                n,
                c,
                oc,
            } => {
                gk::matmul_backward_weight(ctx, dweight, dbias.as_ref(), dout, inp, 1, *n, *c, *oc)?
            }
            Op::Attention {
                out,
                preatt,
                att,
                inp,
                scratch,
                b,
                t,
                c,
                nh,
            } => gk::attention_forward(ctx, out, preatt, att, inp, scratch, *b, *t, *c, *nh)?,
            Op::AttentionBackward {
                dinp,
                dout,
                inp,
                att,
                scratch,
                b,
                t,
                c,
                nh,
            } => gk::attention_backward(ctx, dinp, dout, inp, att, scratch, *b, *t, *c, *nh)?,
            Op::Gelu { out, inp } => gk::gelu_forward(ctx, out, inp)?,
            Op::GeluBackward { dinp, inp, dout } => gk::gelu_backward(ctx, dinp, inp, dout)?,
            Op::Residual { out, a, b } => gk::residual_forward(ctx, out, a, b)?,
            Op::ResidualBackward { da, db, dout } => gk::residual_backward(ctx, da, db, dout)?,
            Op::Softmax {
                probs,
                logits,
                n,
                v,
            } => gk::softmax_forward(ctx, probs, logits, 1, *n, *v)?,
            Op::SoftmaxCrossEntropy {
                probs,
                losses,
                logits,
                targets,
                n,
                v,
            } => {
                // SAFETY: `targets` is the model's target buffer, checked on
                // the host to hold ids below the vocabulary size `v` before
                // upload (module docs).
                unsafe {
                    gk::softmax_crossentropy_forward(ctx, probs, losses, logits, targets, 1, *n, *v)
                }?
            }
            Op::MeanLoss { loss, losses } => gk::mean_loss(ctx, loss, losses)?,
            Op::CrossEntropySoftmaxBackward {
                dlogits,
                probs,
                targets,
                dloss,
                n,
                v,
            } => {
                gk::crossentropy_softmax_backward(ctx, dlogits, probs, targets, *dloss, 1, *n, *v)?
            }
            Op::Zero { out } => {
                // Checks that `out` is declared `write` by this task and lives
                // on this device; the address of its first byte.
                let ptr = ctx.device_ptr(out, true)?;
                if !out.is_empty() {
                    // SAFETY: `ptr..ptr + out.len()` is the declared, exclusive
                    // (`write`) view `out` of a live device buffer of the
                    // stream's device (checked by `device_ptr`); the engine
                    // keeps the buffer alive until the task's end event, which
                    // is recorded on this stream after the memset.
                    unsafe { braid::cuda::memory::memset_d8_async(ptr, 0, out.len(), cu.stream()) }
                        .map_err(braid::Error::from)?;
                }
            }
            Op::SumSquares {
                partial,
                scratch,
                grads,
            } => gk::grad_norm_sq(ctx, partial, scratch, grads)?,
            Op::ClipScale {
                scale,
                partials,
                max_norm,
            } => gk::grad_clip_scale(ctx, scale, partials, *max_norm)?,
            Op::AdamW {
                params,
                grads,
                m,
                v,
                scale,
                step,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => gk::adamw_update(
                ctx,
                params,
                grads,
                m,
                v,
                scale.as_ref(),
                *step,
                *lr,
                *beta1,
                *beta2,
                *eps,
                *weight_decay,
            )?,
        }
        Ok(())
    }
}

/// The global L2 norm from per-chunk sums of squares, added in chunk order.
pub(crate) fn global_norm(partials: &[f64]) -> f64 {
    partials.iter().sum::<f64>().sqrt()
}

/// Submits `op` as the task `name`, declaring exactly [`Op::accesses`].
pub(crate) fn submit(
    rt: &Runtime,
    name: impl Into<Cow<'static, str>>,
    priority: Priority,
    op: Op,
) -> braid::Result<TaskHandle> {
    let mut b = rt.task(name).priority(priority);
    for (view, mode) in op.accesses() {
        b = b.access(view, mode);
    }
    b.run_ctx(move |ctx| op.run(ctx))
}
