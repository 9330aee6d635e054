//! `models/gpt2/src/kernels/adamw.cu`: the AdamW update, `f32`, and mixed
//! precision (f32 master weights, stored weights and gradients `f32` or
//! bf16), one thread per element.

use crate::check::count;
use crate::launch::Args;
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
    args: Args<'a>,
    grad_scale: Option<&'a [f32]>,
    n: i64,
    s: AdamwScalars,
    scalars: Option<&'a [f32]>,
) -> Result<Args<'a>, String> {
    let hyper = [s.step_size, s.bc2_sqrt, s.beta1, s.beta2, s.eps, s.decay];
    args.input_or_null("grad_scale", grad_scale, 1)?
        .i64(n)
        .f32s(hyper)
        .input_or_null("scalars", scalars, 3)
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
    let args = Args::new(k)
        .output("params", params, len)?
        .input("grads", grads, len)?
        .output("m", m, len)?
        .output("v", v, len)?;
    let args = tail(args, grad_scale, n, s, scalars)?;
    // SAFETY: the kernel touches element i < N of the four arrays (N long),
    // grad_scale[0] and scalars[0..3] when not null (checked above).
    unsafe { args.launch(grid, block) }
}

twins! {
    /// `adamw_update_mixed_f32`: one [`adamw_update`] of the f32 `master`
    /// weights from the stored gradients, then `params = master` (f32 storage).
    /// The launcher (adamw.rs, `adamw_update_mixed_cuda`): four elements a
    /// thread (vector loads where aligned), grid `ceil(N / 1024)`, block 256.
    pub fn adamw_update_mixed_f32(S = f32);
    /// [`adamw_update_mixed_f32`] with bf16 stored weights and gradients
    /// (`params` the master weights rounded).
    pub fn adamw_update_mixed_bf16(S = u16);
    fn(
        k,
        grid: Dim3,
        block: Dim3,
        params: &mut [S],
        master: &mut [f32],
        grads: &[S],
        m: &mut [f32],
        v: &mut [f32],
        grad_scale: Option<&[f32]>,
        n: i64,
        s: AdamwScalars,
        scalars: Option<&[f32]>,
    ) {
        let len = count(k, n)?;
        let args = Args::new(k)
            .output("params", params, len)?
            .output("master", master, len)?
            .input("grads", grads, len)?
            .output("m", m, len)?
            .output("v", v, len)?;
        let args = tail(args, grad_scale, n, s, scalars)?;
        // SAFETY: adamw_update_mixed_{f32,bf16} touches element i < N of the
        // five arrays (N long), grad_scale[0] and scalars[0..3] when not null
        // (checked above).
        unsafe { args.launch(grid, block) }
    }
}
