//! `models/gpt2/src/kernels/adamw.cu`: the AdamW update, `f32`, and mixed
//! precision (f32 master weights, stored weights and gradients `f32` or
//! bf16), one thread per element.

use crate::check::{count, need};
use crate::launch::{launch, Arg, Elem};
use crate::Dim3;

/// The scalar arguments of the AdamW kernels, in their order: the per-step
/// `step_size = lr / (1 - beta1^t)`, `bc2_sqrt = sqrt(1 - beta2^t)` and
/// `decay = 1 - lr · weight_decay` (computed on the host, or replaced by a
/// `scalars` buffer), and the hyper-parameters `beta1`, `beta2`, `eps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwScalars {
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub decay: f32,
}

/// The kernels' common tail, `(const float* grad_scale, long long N, float
/// step_size, float bc2_sqrt, float beta1, float beta2, float eps, float
/// decay, const float* scalars)`, with the optional one-element
/// `grad_scale` and three-element `scalars` checked.
fn tail<'a>(
    k: &str,
    grad_scale: Option<&'a [f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&'a [f32]>,
) -> Result<Vec<Arg<'a>>, String> {
    if let Some(s) = grad_scale {
        need(k, "grad_scale", s.len(), 1)?;
    }
    if let Some(s) = scalars {
        need(k, "scalars", s.len(), 3)?;
    }
    let hyper = [s.step_size, s.bc2_sqrt, s.beta1, s.beta2, s.eps, s.decay];
    let mut args = vec![Arg::input_or_null("grad_scale", grad_scale), Arg::I64(n)];
    args.extend(hyper.map(Arg::F32));
    args.push(Arg::input_or_null("scalars", scalars));
    Ok(args)
}

/// `adamw_update`: one AdamW step of `params` (`N`, f32) from `grads`, the
/// moments `m` and `v`; gradients times `grad_scale[0]` when given; the
/// per-step scalars of `s` replaced by `scalars[0..3]` when given. The
/// launcher (adamw.rs, `adamw_update_cuda`): one thread per element, grid
/// `ceil(N / 256)`, block 256.
pub fn adamw_update(
    grid: Dim3,
    block: Dim3,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: Option<&[f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&[f32]>,
) -> Result<(), String> {
    let k = "adamw_update";
    let len = count(k, n)?;
    need(k, "params", params.len(), len)?;
    need(k, "grads", grads.len(), len)?;
    need(k, "m", m.len(), len)?;
    need(k, "v", v.len(), len)?;
    let tail = tail(k, grad_scale, n, s, scalars)?;
    let mut args = vec![
        Arg::output("params", params),
        Arg::input("grads", grads),
        Arg::output("m", m),
        Arg::output("v", v),
    ];
    args.extend(tail);
    // SAFETY: the kernel touches element i < N of the four arrays (N long),
    // grad_scale[0] and scalars[0..3] when not null (checked above).
    unsafe { launch(k, grid, block, args) }
}

fn mixed<S: Elem>(
    k: &str,
    grid: Dim3,
    block: Dim3,
    (params, master, grads): (&mut [S], &mut [f32], &[S]),
    (m, v): (&mut [f32], &mut [f32]),
    grad_scale: Option<&[f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&[f32]>,
) -> Result<(), String> {
    let len = count(k, n)?;
    need(k, "params", params.len(), len)?;
    need(k, "master", master.len(), len)?;
    need(k, "grads", grads.len(), len)?;
    need(k, "m", m.len(), len)?;
    need(k, "v", v.len(), len)?;
    let tail = tail(k, grad_scale, n, s, scalars)?;
    let mut args = vec![
        Arg::output("params", params),
        Arg::output("master", master),
        Arg::input("grads", grads),
        Arg::output("m", m),
        Arg::output("v", v),
    ];
    args.extend(tail);
    // SAFETY: adamw_update_mixed_{f32,bf16} touches element i < N of the
    // five arrays (N long), grad_scale[0] and scalars[0..3] when not null
    // (checked above).
    unsafe { launch(k, grid, block, args) }
}

/// `adamw_update_mixed_f32`: one [`adamw_update`] of the f32 `master`
/// weights from the stored gradients, then `params = master` (f32 storage).
/// The launcher (adamw.rs, `adamw_update_mixed_cuda`): one thread per
/// element, grid `ceil(N / 256)`, block 256.
pub fn adamw_update_mixed_f32(
    grid: Dim3,
    block: Dim3,
    params: &mut [f32],
    master: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: Option<&[f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&[f32]>,
) -> Result<(), String> {
    let k = "adamw_update_mixed_f32";
    let w = (params, master, grads);
    mixed(k, grid, block, w, (m, v), grad_scale, n, s, scalars)
}

/// [`adamw_update_mixed_f32`] with bf16 stored weights and gradients
/// (`params` the master weights rounded).
pub fn adamw_update_mixed_bf16(
    grid: Dim3,
    block: Dim3,
    params: &mut [u16],
    master: &mut [f32],
    grads: &[u16],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: Option<&[f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&[f32]>,
) -> Result<(), String> {
    let k = "adamw_update_mixed_bf16";
    let w = (params, master, grads);
    mixed(k, grid, block, w, (m, v), grad_scale, n, s, scalars)
}
