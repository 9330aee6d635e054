//! The forward pass as tasks ([`Gpt2Model::forward_uploaded`] and
//! [`Gpt2Model::forward_for_backward`] call it).

use braid::{Runtime, View};

use super::{Gpt2Model, Tasks};
use crate::error::Result;
use crate::kernels::{
    attention, encoder, fill, flash_attention, fused_classifier, gelu, layernorm, loss, matmul,
    residual,
};

impl Gpt2Model {
    /// The forward pass. With targets, fused: the losses and their mean only
    /// if `losses`; unfused: always (the probabilities they come with are
    /// what the backward pass reads).
    pub(super) fn forward_pass(&self, rt: &Runtime, losses: bool) -> Result<()> {
        let tasks = Tasks {
            rt,
            dtype: self.dtype,
        };
        let (b, t, n) = (self.b, self.t, self.b * self.t);
        let (c, v, nh) = (self.cfg.channels, self.cfg.vocab_size, self.cfg.num_heads);
        let vp = self.vp;
        let (p, a) = (&self.p, &self.a);
        let (tokens, targets) = (self.tokens.whole(), self.targets.whole());
        let (scratch_fwd, loss) = (&self.att_scratch_fwd, self.loss.whole());
        // Scopes (`forward/encoder`, `forward/layer{l}`, `forward/head`)
        // name the parts of the pass for the trace and the placement file.
        let _forward = rt.scope("forward");
        // The classifier's weight, `wte` padded to `Vp` rows if the model
        // keeps a padded copy (refreshed here, off the critical path: only
        // the logits product at the end reads it).
        let (w_classifier, oc) = self.refresh_classifier_weight(&tasks)?;

        // encoded = wte[tokens] + wpe
        let encoder_scope = rt.scope("encoder");
        // SAFETY: `tokens` holds ids checked against V above (module docs).
        unsafe {
            encoder::forward(
                tasks.task("encoder forward"),
                &a.encoded,
                &tokens,
                &p.wte,
                &p.wpe,
                b,
                t,
                c,
            )
        }?;
        drop(encoder_scope);
        for (l, (la, lp)) in a.layers.iter().zip(&p.layers).enumerate() {
            let _layer = rt.scope(&format!("layer{l}"));
            let task = |what: &str| tasks.task(format!("L{l} {what}"));
            let residual = a.residual_in(l);
            // Fused, block l > 0's ln1 came with block l - 1's residual3.
            if !self.fusion.residual_layernorm || l == 0 {
                layernorm::forward(
                    task("ln1 forward"),
                    &la.ln1,
                    &la.ln1_mean,
                    &la.ln1_rstd,
                    residual,
                    &lp.ln1w,
                    &lp.ln1b,
                    n,
                    c,
                )?;
            }
            matmul::forward(
                task("qkv forward"),
                &la.qkv,
                &la.ln1,
                &lp.qkvw,
                Some(&lp.qkvb),
                n,
                c,
                3 * c,
            )?;
            if self.fusion.attention {
                // `att` holds the per-row logsumexp, (B, NH, T).
                flash_attention::forward(
                    task("attention forward"),
                    &la.atty,
                    &la.att,
                    &la.qkv,
                    b,
                    t,
                    c,
                    nh,
                )?;
            } else {
                attention::forward(
                    task("attention forward"),
                    &la.atty,
                    &la.preatt,
                    &la.att,
                    &la.qkv,
                    scratch_fwd,
                    b,
                    t,
                    c,
                    nh,
                )?;
            }
            matmul::forward(
                task("attproj forward"),
                &la.attproj,
                &la.atty,
                &lp.attprojw,
                Some(&lp.attprojb),
                n,
                c,
                c,
            )?;
            if self.fusion.residual_layernorm {
                layernorm::forward_residual(
                    task("residual2+ln2 forward"),
                    &la.residual2,
                    &la.ln2,
                    &la.ln2_mean,
                    &la.ln2_rstd,
                    residual,
                    &la.attproj,
                    &lp.ln2w,
                    &lp.ln2b,
                    n,
                    c,
                )?;
            } else {
                residual::forward(
                    task("residual2 forward"),
                    &la.residual2,
                    residual,
                    &la.attproj,
                )?;
                layernorm::forward(
                    task("ln2 forward"),
                    &la.ln2,
                    &la.ln2_mean,
                    &la.ln2_rstd,
                    &la.residual2,
                    &lp.ln2w,
                    &lp.ln2b,
                    n,
                    c,
                )?;
            }
            if matmul::gelu_epilogue(rt.cuda_device().is_some()) {
                // One task; on CUDA in bf16 one cuBLASLt product.
                matmul::forward_gelu(
                    task("fc forward"),
                    &la.fch_gelu,
                    &la.fch,
                    &la.ln2,
                    &lp.fcw,
                    &lp.fcb,
                    n,
                    c,
                    4 * c,
                )?;
            } else {
                matmul::forward(
                    task("fc forward"),
                    &la.fch,
                    &la.ln2,
                    &lp.fcw,
                    Some(&lp.fcb),
                    n,
                    c,
                    4 * c,
                )?;
                gelu::forward(task("gelu forward"), &la.fch_gelu, &la.fch)?;
            }
            matmul::forward(
                task("fcproj forward"),
                &la.fcproj,
                &la.fch_gelu,
                &lp.fcprojw,
                Some(&lp.fcprojb),
                n,
                4 * c,
                c,
            )?;
            if self.fusion.residual_layernorm {
                // With the next layer norm: block l + 1's ln1, or lnf.
                let (name, out, mean, rstd, w, bias) =
                    match (a.layers.get(l + 1), p.layers.get(l + 1)) {
                        (Some(na), Some(np)) => (
                            "residual3+ln1 forward",
                            &na.ln1,
                            &na.ln1_mean,
                            &na.ln1_rstd,
                            &np.ln1w,
                            &np.ln1b,
                        ),
                        _ => (
                            "residual3+lnf forward",
                            &a.lnf,
                            &a.lnf_mean,
                            &a.lnf_rstd,
                            &p.lnfw,
                            &p.lnfb,
                        ),
                    };
                layernorm::forward_residual(
                    task(name),
                    &la.residual3,
                    out,
                    mean,
                    rstd,
                    &la.residual2,
                    &la.fcproj,
                    w,
                    bias,
                    n,
                    c,
                )?;
            } else {
                residual::forward(
                    task("residual3 forward"),
                    &la.residual3,
                    &la.residual2,
                    &la.fcproj,
                )?;
            }
        }
        let _head = rt.scope("head");
        if !self.fusion.residual_layernorm {
            layernorm::forward(
                tasks.task("lnf forward"),
                &a.lnf,
                &a.lnf_mean,
                &a.lnf_rstd,
                a.residual_out(),
                &p.lnfw,
                &p.lnfb,
                n,
                c,
            )?;
        }
        // logits = lnf · wteᵀ, over `Vp` columns with the padded
        // classifier weight (module docs of `model`).
        matmul::forward_ld(
            tasks.task("logits forward"),
            &a.logits,
            &a.lnf,
            &w_classifier,
            None,
            n,
            c,
            oc,
            vp,
        )?;
        if self.fusion.classifier {
            if self.has_targets && losses {
                fused_classifier::losses(
                    tasks.task("classifier forward"),
                    &a.losses,
                    &a.logits,
                    &targets,
                    n,
                    v,
                    vp,
                )?;
                loss::mean(tasks.task("mean loss"), &loss, &a.losses)?;
            }
        } else if self.has_targets {
            // SAFETY: `targets` holds ids checked against V above (module docs).
            unsafe {
                loss::softmax_crossentropy(
                    tasks.task("softmax crossentropy forward"),
                    &a.probs,
                    &a.losses,
                    &a.logits,
                    &targets,
                    n,
                    v,
                    vp,
                )
            }?;
            loss::mean(tasks.task("mean loss"), &loss, &a.losses)?;
        } else {
            loss::softmax(tasks.task("softmax forward"), &a.probs, &a.logits, n, v, vp)?;
        }
        Ok(())
    }

    /// With a padded classifier weight, submits the copy of `wte` into its
    /// first `V` rows; returns [`classifier_weight`](Self::classifier_weight).
    fn refresh_classifier_weight(&self, tasks: &Tasks<'_>) -> Result<(View, usize)> {
        if let Some(w) = &self.classifier_weight {
            let wte = &self.p.wte;
            fill::copy(tasks.task("classifier weight"), wte, &w.view(0..wte.len())?)?;
        }
        Ok(self.classifier_weight())
    }

    /// The classifier's weight with its row count: the padded copy and
    /// `Vp` if the model keeps one, else `wte` and `V`.
    pub(super) fn classifier_weight(&self) -> (View, usize) {
        match &self.classifier_weight {
            Some(w) => (w.whole(), self.vp),
            None => (self.p.wte.clone(), self.cfg.vocab_size),
        }
    }
}
