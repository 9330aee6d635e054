//! The backward pass as tasks ([`Gpt2Model::backward`]).

use braid::{Priority, Runtime};

use super::{Gpt2Model, Tasks};
use crate::error::{Gpt2Error, Result};
use crate::kernels::{
    attention, encoder, fill, flash_attention, fused_classifier, gelu, layernorm, loss, matmul,
    residual, storage::Dtype, GradWrite,
};
use crate::reference::GELU_RING;

impl Gpt2Model {
    /// Submits the backward pass of the last forward (which must have had
    /// targets): ACCUMULATES `dloss · ∂(mean loss)/∂params` into the gradient
    /// buffer, as [`Reference::backward`](crate::reference::Reference::backward)
    /// does. Call [`zero_grad`](Self::zero_grad) first for a plain step.
    ///
    /// `ready(i)` is called with parameter `i` (its index in
    /// [`param_specs`](Self::param_specs): the index in
    /// [`ParamLayout::tensors`](crate::layout::ParamLayout::tensors) unless
    /// the tied gradient is split into pieces) right after the last task
    /// writing its gradient is submitted, in backward order: hand it to
    /// [`Reducer::grad_ready`](braid::Reducer::grad_ready).
    pub fn backward(
        &mut self,
        rt: &Runtime,
        dloss: f32,
        mut ready: impl FnMut(usize) -> braid::Result<()>,
    ) -> Result<()> {
        if !self.has_targets {
            return Err(Gpt2Error::InvalidSetting {
                what: "backward pass",
                reason: "it needs a forward pass with targets first".into(),
            });
        }
        let tasks = Tasks {
            rt,
            dtype: self.dtype,
        };
        let (b, t, n) = (self.b, self.t, self.b * self.t);
        let (c, v, nh) = (self.cfg.channels, self.cfg.vocab_size, self.cfg.num_heads);
        let vp = self.vp;
        let tr = self.training()?;
        let (p, g, a, da, id) = (&self.p, &tr.g, &self.a, &tr.da, &self.ids);
        let (tokens, targets) = (self.tokens.whole(), self.targets.whole());
        let scratch_bwd = &tr.att_scratch_bwd;
        let ln_scratch = &tr.ln_scratch.whole();
        let side = |name: String| tasks.task(name).priority(Priority::Side);
        // Scopes: `backward/head`, `backward/layer{l}`, `backward/encoder`
        // (the zeroing of the activation gradients is in `backward`).
        let _backward = rt.scope("backward");

        // With the fused residual + layer norm and the fused attention, every
        // activation gradient has one writer in the step, which writes it
        // over (`GradWrite::Set`): nothing is zeroed but the last block's
        // output gradient, which the final layer norm's backward adds into
        // (and the unfused classifier's logits gradient, in the head).
        // Otherwise activation gradients accumulate, so they start from
        // zero: the head, each block's residual pair, the first `ring`
        // blocks' ring slots, the encoder's; a later block's slot is zeroed
        // at the end of the block `ring` above it, the slot's previous user
        // (the engine runs the zeroing once that block's last reader of the
        // slot is done).
        let one_writer = self.fusion.residual_layernorm && self.fusion.attention;
        let write = if one_writer {
            GradWrite::Set
        } else {
            GradWrite::Add
        };
        // The MLP's GELU gradient in cuBLASLt's epilogue (bf16, one writer;
        // the CUDA default, `matmul::dgelu_epilogue`).
        let dgelu = one_writer
            && self.dtype == Dtype::Bf16
            && matmul::dgelu_epilogue(rt.cuda_device().is_some());
        let (layers, ring) = (self.cfg.num_layers, da.ring);
        let zero_slot = |l: usize| fill::zero(side(format!("L{l} zero dacts")), &da.blocks[l].0);
        if !one_writer || !self.fusion.classifier {
            fill::zero(side("zero dacts head".into()), &da.head)?;
        }
        if one_writer {
            fill::zero(side("zero dacts out".into()), da.residual_out())?;
        } else {
            for l in (0..layers).rev() {
                fill::zero(side(format!("L{l} zero residual dacts")), &da.blocks[l].1)?;
            }
            for l in (layers.saturating_sub(ring)..layers).rev() {
                zero_slot(l)?;
            }
            fill::zero(side("zero dacts encoded".into()), &da.encoded)?;
        }
        let head_scope = rt.scope("head");

        let dlogits = if self.fusion.classifier {
            // The gradient goes over the logits (and the losses are
            // rewritten, with the same values).
            fused_classifier::forward_backward(
                tasks.task("classifier backward"),
                &a.logits,
                &a.losses,
                &targets,
                dloss,
                n,
                v,
                vp,
            )?;
            // The step's loss, whether or not the forward pass computed it
            // (`forward_for_backward`): the same losses, so the same mean.
            loss::mean(tasks.task("mean loss"), &self.loss.whole(), &a.losses)?;
            &a.logits
        } else {
            loss::backward(
                tasks.task("crossentropy softmax backward"),
                &da.logits,
                &a.probs,
                &targets,
                dloss,
                n,
                v,
                vp,
            )?;
            &da.logits
        };
        // logits = lnf · wᵀ, `w` the padded classifier weight if there is
        // one (its padding rows and the logits' padding columns are zero).
        let (w, k) = self.classifier_weight();
        let input_grad = || {
            matmul::backward_input_ld(
                tasks.task("logits backward input"),
                &da.lnf,
                write,
                dlogits,
                &w,
                n,
                c,
                k,
                vp,
            )
        };
        if self.split_tied {
            // The classifier is `wte`'s first writer; the encoder's rows go
            // to the reducer on their own. Its part in row blocks, each
            // ready (and all-reduced) while the next is computed, all of
            // them submitted before the input gradient: on one stream their
            // all-reduces then run under the input gradient and the blocks'
            // backward (submitted after, they had only the blocks' backward
            // to hide under); on two, the side stream takes them either way.
            for (i, (rows, dw)) in self.wte_pieces.iter().enumerate() {
                matmul::backward_weight_rows(
                    side(format!("logits backward weight {i}")),
                    dw,
                    dlogits,
                    &a.lnf,
                    n,
                    c,
                    v,
                    vp,
                    rows.clone(),
                )?;
                ready(id.wte + i)?;
            }
            input_grad()?;
        } else if let Some(dw) = &tr.classifier_grad {
            input_grad()?;
            // The padded classifier weight's gradient, all `Vp` rows, in a
            // buffer of its own (its padding rows are zero: so are the
            // logits gradient's padding columns), then its first `V` rows
            // added into `wte`'s.
            let dw_wte = dw.view(0..g.wte.len())?;
            fill::zero(side("zero classifier weight grad".into()), &dw.whole())?;
            matmul::backward_weight_ld(
                side("logits backward weight".into()),
                &dw.whole(),
                None,
                dlogits,
                &a.lnf,
                n,
                c,
                vp,
                vp,
            )?;
            residual::accumulate(side("classifier weight grad".into()), &g.wte, &dw_wte)?;
        } else {
            input_grad()?;
            matmul::backward_weight_ld(
                side("logits backward weight".into()),
                &g.wte,
                None,
                dlogits,
                &a.lnf,
                n,
                c,
                v,
                vp,
            )?;
        }
        // lnf = layernorm(residual_out)
        layernorm::backward(
            tasks.task("lnf backward"),
            da.residual_out(),
            &g.lnfw,
            &g.lnfb,
            &da.lnf,
            a.residual_out(),
            &p.lnfw,
            &a.lnf_mean,
            &a.lnf_rstd,
            ln_scratch,
            n,
            c,
        )?;
        ready(id.lnfb)?;
        ready(id.lnfw)?;

        drop(head_scope);
        for l in (0..self.cfg.num_layers).rev() {
            let _layer = rt.scope(&format!("layer{l}"));
            let (la, lda, lp, lg, li) = (
                &a.layers[l],
                &da.layers[l],
                &p.layers[l],
                &g.layers[l],
                &id.layers[l],
            );
            let task = |what: &str| tasks.task(format!("L{l} {what}"));
            let side = |what: &str| task(what).priority(Priority::Side);
            // residual3 = residual2 + fcproj. Fused, fcproj's gradient is
            // residual3's (no copy), and ln2's backward passes residual3's on
            // to residual2 (`layernorm::backward_residual`).
            let dfcproj = if self.fusion.residual_layernorm {
                &lda.residual3
            } else {
                residual::backward(
                    task("residual3 backward"),
                    &lda.residual2,
                    &lda.fcproj,
                    &lda.residual3,
                )?;
                &lda.fcproj
            };
            // fcproj = fch_gelu · fcprojwᵀ + fcprojb, and (below) fch_gelu =
            // gelu(fch): with the DGELU epilogue on, one task writes fch's
            // gradient (fch_gelu's is never stored).
            if dgelu {
                matmul::backward_input_dgelu(
                    task("fcproj backward input + gelu backward"),
                    &lda.fch,
                    dfcproj,
                    &lp.fcprojw,
                    &la.fch,
                    n,
                    4 * c,
                    c,
                )?;
            } else {
                matmul::backward_input(
                    task("fcproj backward input"),
                    &lda.fch_gelu,
                    write,
                    dfcproj,
                    &lp.fcprojw,
                    n,
                    4 * c,
                    c,
                )?;
            }
            // Fused, fch_gelu lives in the GELU ring: recomputed from fch
            // unless this block's slot still holds it (the last GELU_RING
            // blocks). Only the weight gradient reads it, so Side too.
            if self.fusion.gelu_recompute && l + GELU_RING < self.cfg.num_layers {
                gelu::forward(side("gelu recompute"), &la.fch_gelu, &la.fch)?;
            }
            matmul::backward_weight(
                side("fcproj backward weight"),
                &lg.fcprojw,
                Some(&lg.fcprojb),
                dfcproj,
                &la.fch_gelu,
                n,
                4 * c,
                c,
            )?;
            ready(li.fcprojb)?;
            ready(li.fcprojw)?;
            // fch_gelu = gelu(fch)
            if !dgelu {
                gelu::backward(
                    task("gelu backward"),
                    &lda.fch,
                    write,
                    &la.fch,
                    &lda.fch_gelu,
                )?;
            }
            // fch = ln2 · fcwᵀ + fcb
            matmul::backward_input(
                task("fc backward input"),
                &lda.ln2,
                write,
                &lda.fch,
                &lp.fcw,
                n,
                c,
                4 * c,
            )?;
            matmul::backward_weight(
                side("fc backward weight"),
                &lg.fcw,
                Some(&lg.fcb),
                &lda.fch,
                &la.ln2,
                n,
                c,
                4 * c,
            )?;
            ready(li.fcb)?;
            ready(li.fcw)?;
            // ln2 = layernorm(residual2)
            layernorm::backward_residual(
                task("ln2 backward"),
                &lda.residual2,
                self.fusion.residual_layernorm.then_some(&lda.residual3),
                &lg.ln2w,
                &lg.ln2b,
                &lda.ln2,
                &la.residual2,
                &lp.ln2w,
                &la.ln2_mean,
                &la.ln2_rstd,
                ln_scratch,
                n,
                c,
            )?;
            ready(li.ln2b)?;
            ready(li.ln2w)?;
            // residual2 = residual_in + attproj (fused: as residual3 above)
            let dattproj = if self.fusion.residual_layernorm {
                &lda.residual2
            } else {
                residual::backward(
                    task("residual2 backward"),
                    da.residual_in(l),
                    &lda.attproj,
                    &lda.residual2,
                )?;
                &lda.attproj
            };
            // attproj = atty · attprojwᵀ + attprojb
            matmul::backward_input(
                task("attproj backward input"),
                &lda.atty,
                write,
                dattproj,
                &lp.attprojw,
                n,
                c,
                c,
            )?;
            matmul::backward_weight(
                side("attproj backward weight"),
                &lg.attprojw,
                Some(&lg.attprojb),
                dattproj,
                &la.atty,
                n,
                c,
                c,
            )?;
            ready(li.attprojb)?;
            ready(li.attprojw)?;
            // atty = attention(qkv)
            if self.fusion.attention {
                flash_attention::backward(
                    task("attention backward"),
                    &lda.qkv,
                    write,
                    &lda.atty,
                    &la.qkv,
                    &la.atty,
                    &la.att,
                    scratch_bwd,
                    tr.att_ds.as_ref(),
                    b,
                    t,
                    c,
                    nh,
                )?;
            } else {
                attention::backward(
                    task("attention backward"),
                    &lda.qkv,
                    &lda.atty,
                    &la.qkv,
                    &la.att,
                    scratch_bwd,
                    b,
                    t,
                    c,
                    nh,
                )?;
            }
            // qkv = ln1 · qkvwᵀ + qkvb
            matmul::backward_input(
                task("qkv backward input"),
                &lda.ln1,
                write,
                &lda.qkv,
                &lp.qkvw,
                n,
                c,
                3 * c,
            )?;
            matmul::backward_weight(
                side("qkv backward weight"),
                &lg.qkvw,
                Some(&lg.qkvb),
                &lda.qkv,
                &la.ln1,
                n,
                c,
                3 * c,
            )?;
            ready(li.qkvb)?;
            ready(li.qkvw)?;
            // ln1 = layernorm(residual_in)
            layernorm::backward_residual(
                task("ln1 backward"),
                da.residual_in(l),
                self.fusion.residual_layernorm.then_some(&lda.residual2),
                &lg.ln1w,
                &lg.ln1b,
                &lda.ln1,
                a.residual_in(l),
                &lp.ln1w,
                &la.ln1_mean,
                &la.ln1_rstd,
                ln_scratch,
                n,
                c,
            )?;
            ready(li.ln1b)?;
            ready(li.ln1w)?;
            // Block l is done with its slot: block l - ring's turn.
            if l >= ring && !one_writer {
                zero_slot(l - ring)?;
            }
        }

        // encoded = wte[tokens] + wpe
        let _encoder = rt.scope("encoder");
        if self.split_tied {
            encoder::backward_positions(
                tasks.task("encoder backward positions"),
                &g.wpe,
                &da.encoded,
                b,
                t,
                c,
            )?;
            ready(id.wpe)?;
            return Ok(());
        }
        // SAFETY: `tokens` holds ids checked against V by `forward` (module docs).
        unsafe {
            encoder::backward(
                tasks.task("encoder backward"),
                &g.wte,
                &g.wpe,
                &da.encoded,
                &tokens,
                &tr.links.whole(),
                b,
                t,
                c,
            )
        }?;
        ready(id.wpe)?;
        ready(id.wte)?;
        Ok(())
    }
}
