//! `models/gpt2/src/kernels/adamw.cu`: the AdamW update, `f32`, and mixed
//! precision (f32 master weights, stored weights and gradients `f32` or
//! bf16), one thread per element.

use bytemuck::Pod;

use super::{count, present, ptr_or_null};
use crate::{finish, need, Dim3, Guarded};

#[rustfmt::skip]
mod ffi {
    use std::ffi::c_int;

    /// `adamw_update_mixed_{f32,bf16}(S* params, float* master, const S*
    /// grads, float* m, float* v, const float* grad_scale, long long N,
    /// float step_size, float bc2_sqrt, float beta1, float beta2, float eps,
    /// float decay, const float* scalars)`.
    pub type Mixed<S> = unsafe extern "C" fn(
        u32, u32, u32, u32, u32, u32,
        *mut S, *mut f32, *const S, *mut f32, *mut f32, *const f32, i64,
        f32, f32, f32, f32, f32, f32, *const f32,
    ) -> c_int;

    extern "C" {
        pub fn emu_adamw_update(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            params: *mut f32, grads: *const f32, m: *mut f32, v: *mut f32,
            grad_scale: *const f32, n: i64, step_size: f32, bc2_sqrt: f32, beta1: f32,
            beta2: f32, eps: f32, decay: f32, scalars: *const f32,
        ) -> c_int;
        pub fn emu_adamw_update_mixed_f32(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            params: *mut f32, master: *mut f32, grads: *const f32, m: *mut f32, v: *mut f32,
            grad_scale: *const f32, n: i64, step_size: f32, bc2_sqrt: f32, beta1: f32,
            beta2: f32, eps: f32, decay: f32, scalars: *const f32,
        ) -> c_int;
        pub fn emu_adamw_update_mixed_bf16(
            gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
            params: *mut u16, master: *mut f32, grads: *const u16, m: *mut f32, v: *mut f32,
            grad_scale: *const f32, n: i64, step_size: f32, bc2_sqrt: f32, beta1: f32,
            beta2: f32, eps: f32, decay: f32, scalars: *const f32,
        ) -> c_int;
    }
}

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

/// The optional one-element `grad_scale` and three-element `scalars`,
/// checked and guarded.
fn optional<'a>(
    k: &str,
    grad_scale: Option<&'a [f32]>,
    scalars: Option<&'a [f32]>,
) -> Result<(Option<Guarded<'a>>, Option<Guarded<'a>>), String> {
    if let Some(s) = grad_scale {
        need(k, "grad_scale", s.len(), 1)?;
    }
    if let Some(s) = scalars {
        need(k, "scalars", s.len(), 3)?;
    }
    Ok((
        grad_scale.map(|s| Guarded::input("grad_scale", s)),
        scalars.map(|s| Guarded::input("scalars", s)),
    ))
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
    let (mut gs, mut sc) = optional(k, grad_scale, scalars)?;
    let (mut p, mut g, mut gm, mut gv) = (
        Guarded::output("params", params),
        Guarded::input("grads", grads),
        Guarded::output("m", m),
        Guarded::output("v", v),
    );
    // SAFETY: adamw_update(float* params, const float* grads, float* m,
    // float* v, const float* grad_scale, long long N, float step_size, float
    // bc2_sqrt, float beta1, float beta2, float eps, float decay, const
    // float* scalars) touches element i < N of the four arrays (N long),
    // grad_scale[0] and scalars[0..3] when not null (checked above).
    let rc = unsafe {
        ffi::emu_adamw_update(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            p.ptr(),
            g.ptr(),
            gm.ptr(),
            gv.ptr(),
            ptr_or_null(&mut gs),
            n,
            s.step_size,
            s.bc2_sqrt,
            s.beta1,
            s.beta2,
            s.eps,
            s.decay,
            ptr_or_null(&mut sc),
        )
    };
    let bufs = [Some(p), Some(g), Some(gm), Some(gv), gs, sc];
    finish(k, rc, present(bufs))
}

fn mixed<S: Pod>(
    k: &str,
    f: ffi::Mixed<S>,
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
    let (mut gs, mut sc) = optional(k, grad_scale, scalars)?;
    let (mut p, mut w, mut g, mut gm, mut gv) = (
        Guarded::output("params", params),
        Guarded::output("master", master),
        Guarded::input("grads", grads),
        Guarded::output("m", m),
        Guarded::output("v", v),
    );
    // SAFETY: `f` is adamw_update_mixed_{f32,bf16} (ffi::Mixed); it touches
    // element i < N of the five arrays (N long), grad_scale[0] and
    // scalars[0..3] when not null (checked above).
    let rc = unsafe {
        f(
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            p.ptr(),
            w.ptr(),
            g.ptr(),
            gm.ptr(),
            gv.ptr(),
            ptr_or_null(&mut gs),
            n,
            s.step_size,
            s.bc2_sqrt,
            s.beta1,
            s.beta2,
            s.eps,
            s.decay,
            ptr_or_null(&mut sc),
        )
    };
    let bufs = [Some(p), Some(w), Some(g), Some(gm), Some(gv), gs, sc];
    finish(k, rc, present(bufs))
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
    let f: ffi::Mixed<f32> = ffi::emu_adamw_update_mixed_f32;
    let k = "adamw_update_mixed_f32";
    let w = (params, master, grads);
    mixed(k, f, grid, block, w, (m, v), grad_scale, n, s, scalars)
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
    let f: ffi::Mixed<u16> = ffi::emu_adamw_update_mixed_bf16;
    let k = "adamw_update_mixed_bf16";
    let w = (params, master, grads);
    mixed(k, f, grid, block, w, (m, v), grad_scale, n, s, scalars)
}
