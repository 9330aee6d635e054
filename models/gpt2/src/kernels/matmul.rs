//! Linear layers: `out = inp · Wᵀ + bias` with `W` stored `(OC, C)`, and the
//! two halves of its backward pass, which the engine runs as separate tasks
//! (the input gradient is on the critical path, the weight gradient is not).
//!
//! The family's one home: the tasks [`forward`], [`backward_input`] and
//! [`backward_weight`], the CPU kernels [`matmul_forward`],
//! [`matmul_backward_input`] and [`matmul_backward_weight`] (through `gemm`,
//! single-threaded), their CUDA launchers (cuBLAS for the products, `matmul.cu`
//! for the bias). Rows are `n = B·T` positions. The three tasks have a CUDA
//! body for bf16 storage too (cuBLAS `gemm_bf16` and the `*_bf16` bias
//! kernels). There cuBLAS rounds each product to bf16 before adding what the
//! output held (the bias, or the gradient accumulated so far), so a bf16
//! CUDA result is rounded twice where the CPU's is rounded once: within a
//! bf16 step of the product's magnitude (`tests/cuda_kernels/`).
//!
//! The `_ld` variants take the `(N, OC)` side (the output, or its gradient)
//! with rows `ld >= OC` elements apart, BLAS's leading dimension: GPT-2's
//! classifier writes its logits into rows padded to
//! [`Gpt2Config::padded_vocab`](crate::config::Gpt2Config::padded_vocab)
//! so that every row starts aligned. Columns `OC..ld` are neither read nor
//! written.

use braid::cuda::{Epilogue, Gemm, KernelArgs, LaunchConfig, Transpose};
use braid::{CudaTaskCtx, DevSlice, DevSliceMut, Result, TaskHandle, View};
use gemm::{gemm, Parallelism};

use super::cuda_common::{by_dtype, task_result, Check, Kernel, Launcher, Program};
use super::storage::{Dtype, Storage};
use super::task::{submit, Task};
use super::{check_len, check_stride, GradWrite};

pub(crate) static CUDA: Program = Program::new(
    "matmul.cu",
    include_str!("matmul.cu"),
    &[
        "bias_broadcast",
        "bias_backward",
        "bias_broadcast_bf16",
        "bias_backward_bf16",
    ],
);
static BIAS_BROADCAST: Kernel = Kernel::new(&CUDA, 0);
static BIAS_BACKWARD: Kernel = Kernel::new(&CUDA, 1);
static BIAS_BROADCAST_BF16: Kernel = Kernel::new(&CUDA, 2);
static BIAS_BACKWARD_BF16: Kernel = Kernel::new(&CUDA, 3);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

/// Submits `out = inp · weightᵀ + bias` as `task`.
pub fn forward<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,          // (N, OC)
    inp: &View,          // (N, C)
    weight: &View,       // (OC, C)
    bias: Option<&View>, // (OC)
    n: usize,
    c: usize,
    oc: usize,
) -> Result<TaskHandle> {
    forward_ld(task, out, inp, weight, bias, n, c, oc, oc)
}

/// [`forward`] into rows `ld` elements apart (module docs).
pub fn forward_ld<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,          // (N, ld), columns 0..OC written
    inp: &View,          // (N, C)
    weight: &View,       // (OC, C)
    bias: Option<&View>, // (OC)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            out.write::<S>(),
            inp.read::<S>(),
            weight.read::<S>(),
            bias.map(|b| b.read::<S>()),
        ),
        move |(out, inp, w, bias)| matmul_forward_ld(out, inp, w, bias, n, c, oc, ld),
        move |(out, inp, w, bias), cu| {
            task_result(matmul_forward_cuda(cu, out, inp, w, bias, n, c, oc, ld))
        },
    )
}

/// Submits `pre = inp · weightᵀ + bias; out = gelu(pre)` as one task (the
/// MLP's first layer and its activation). On the CPU, and on CUDA unless
/// [`gelu_epilogue`] is on, it runs the product and then the GELU kernel:
/// bit for bit [`forward`] then [`gelu::forward`](super::gelu::forward).
/// With [`gelu_epilogue`] on CUDA (bf16, operands that fit) one cuBLASLt
/// product writes both: `pre` and `out` each rounded once from the f32
/// accumulator plus the bias, so `out` may differ from the GELU of the
/// stored `pre` by a bf16 ulp.
#[allow(clippy::too_many_arguments)]
pub fn forward_gelu<'rt>(
    task: impl Into<Task<'rt>>,
    out: &View,    // (N, OC)
    pre: &View,    // (N, OC)
    inp: &View,    // (N, C)
    weight: &View, // (OC, C)
    bias: &View,   // (OC)
    n: usize,
    c: usize,
    oc: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            out.write::<S>(),
            pre.write::<S>(),
            inp.read::<S>(),
            weight.read::<S>(),
            bias.read::<S>(),
        ),
        move |(out, pre, inp, w, bias)| {
            matmul_forward_ld(pre, inp, w, Some(bias), n, c, oc, oc);
            super::gelu::gelu_forward(out, pre);
        },
        move |(out, pre, inp, w, bias), cu| {
            let lt =
                gelu_epilogue(true) && gelu_epilogue_fits::<S>(&out, &pre, &inp, &w, &bias, c, oc);
            task_result(matmul_forward_gelu_cuda(
                cu,
                out,
                pre,
                inp,
                w,
                bias,
                (n, c, oc),
                lt,
            ))
        },
    )
}

/// Submits `dinp += dout · weight` (or `=`, by `write`) as `task` (the
/// critical path of backward).
pub fn backward_input<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View, // (N, C) accumulated or overwritten
    write: GradWrite,
    dout: &View,   // (N, OC)
    weight: &View, // (OC, C)
    n: usize,
    c: usize,
    oc: usize,
) -> Result<TaskHandle> {
    backward_input_ld(task, dinp, write, dout, weight, n, c, oc, oc)
}

/// [`backward_input`] from `dout` rows `ld` elements apart (module docs).
pub fn backward_input_ld<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View, // (N, C) accumulated or overwritten
    write: GradWrite,
    dout: &View,   // (N, ld), columns 0..OC read
    weight: &View, // (OC, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (dinp.read_write::<S>(), dout.read::<S>(), weight.read::<S>(),),
        move |(dinp, dout, w)| {
            write.prepare(dinp);
            matmul_backward_input_ld(dinp, dout, w, n, c, oc, ld)
        },
        move |(dinp, dout, w), cu| {
            task_result(matmul_backward_input_cuda(
                cu, dinp, write, dout, w, n, c, oc, ld,
            ))
        },
    )
}

/// Submits `dinp = (dout · weight) ∘ gelu'(pre)` as one task: the input
/// gradient of a product whose output went through a GELU, `pre` the GELU's
/// input, written over `dinp` (its only writer: [`GradWrite::Set`]). On
/// the CPU it is [`backward_input`] then [`gelu::backward`](super::gelu::backward)
/// into a temporary, bit for bit; on CUDA one cuBLASLt product with the
/// `DGELU` epilogue (bf16, operands 16-byte aligned, `C` and `OC` multiples
/// of 8; an error otherwise), the product times the GELU's slope rounded
/// once. What [`dgelu_epilogue`] turns on in the fused model.
pub fn backward_input_dgelu<'rt>(
    task: impl Into<Task<'rt>>,
    dinp: &View,   // (N, C) overwritten
    dout: &View,   // (N, OC)
    weight: &View, // (OC, C)
    pre: &View,    // (N, C)
    n: usize,
    c: usize,
    oc: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dinp.write::<S>(),
            dout.read::<S>(),
            weight.read::<S>(),
            pre.read::<S>(),
        ),
        move |(dinp, dout, w, pre)| {
            let mut grad = vec![S::store(0.0); n * c];
            matmul_backward_input_ld(&mut grad, dout, w, n, c, oc, oc);
            GradWrite::Set.prepare(dinp);
            super::gelu::gelu_backward(dinp, pre, &grad);
        },
        move |(dinp, dout, w, pre), cu| {
            task_result(matmul_backward_input_dgelu_cuda(
                cu,
                dinp,
                dout,
                w,
                pre,
                (n, c, oc),
            ))
        },
    )
}

/// Submits `dweight += doutᵀ · inp; dbias += Σ dout` as `task` (off the
/// critical path: give it [`Priority::Side`](braid::Priority::Side)).
pub fn backward_weight<'rt>(
    task: impl Into<Task<'rt>>,
    dweight: &View,       // (OC, C) accumulated
    dbias: Option<&View>, // (OC) accumulated
    dout: &View,          // (N, OC)
    inp: &View,           // (N, C)
    n: usize,
    c: usize,
    oc: usize,
) -> Result<TaskHandle> {
    backward_weight_ld(task, dweight, dbias, dout, inp, n, c, oc, oc)
}

/// [`backward_weight`] from `dout` rows `ld` elements apart (module docs).
pub fn backward_weight_ld<'rt>(
    task: impl Into<Task<'rt>>,
    dweight: &View,       // (OC, C) accumulated
    dbias: Option<&View>, // (OC) accumulated
    dout: &View,          // (N, ld), columns 0..OC read
    inp: &View,           // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<TaskHandle> {
    submit!(
        task,
        |S| (
            dweight.read_write::<S>(),
            dbias.map(|d| d.read_write::<S>()),
            dout.read::<S>(),
            inp.read::<S>(),
        ),
        move |(dw, db, dout, inp)| matmul_backward_weight_ld(dw, db, dout, inp, n, c, oc, ld),
        move |(dw, db, dout, inp), cu| {
            task_result(matmul_backward_weight_cuda(
                cu, dw, db, dout, inp, n, c, oc, ld,
            ))
        },
    )
}

/// Submits rows `rows` of [`backward_weight_ld`]'s weight gradient (no bias)
/// as `task`: accumulates `dweight_rows (R, C)`, the gradient of weight rows
/// `rows` (`R = rows.len()`), from columns `rows` of `dout (N, ld)`, which
/// the task declares whole (a read: tasks for other rows run beside it).
/// The tied embedding's classifier gradient is made in such row blocks, so
/// that each block's all-reduce starts while the next is computed (the
/// CUDA body: [`matmul_backward_weight_rows_cuda`]).
pub fn backward_weight_rows<'rt>(
    task: impl Into<Task<'rt>>,
    dweight_rows: &View, // (R, C) accumulated
    dout: &View,         // (N, ld)
    inp: &View,          // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
    rows: std::ops::Range<usize>,
) -> Result<TaskHandle> {
    let cuda_rows = rows.clone();
    submit!(
        task,
        |S| (
            dweight_rows.read_write::<S>(),
            dout.read::<S>(),
            inp.read::<S>()
        ),
        move |(dw, dout, inp)| {
            matmul_backward_weight_rows(dw, dout, inp, n, c, oc, ld, rows.clone())
        },
        move |(dw, dout, inp), cu| {
            task_result(matmul_backward_weight_rows_cuda(
                cu,
                dw,
                dout,
                inp,
                n,
                c,
                oc,
                ld,
                cuda_rows.clone(),
            ))
        },
    )
}

// ---------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------

/// A row-major-or-strided view of an `rows x cols` matrix inside a slice.
#[derive(Clone, Copy)]
struct Strided {
    rows: usize,
    cols: usize,
    /// Element stride between consecutive rows.
    rs: usize,
    /// Element stride between consecutive columns.
    cs: usize,
}

impl Strided {
    /// A row-major `rows x cols` matrix.
    fn row_major(rows: usize, cols: usize) -> Strided {
        Strided::padded(rows, cols, cols)
    }

    /// A row-major `rows x cols` matrix whose rows are `ld >= cols`
    /// elements apart.
    fn padded(rows: usize, cols: usize, ld: usize) -> Strided {
        Strided {
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose of a row-major `cols x rows` matrix, seen as
    /// `rows x cols`: element `(i, j)` is at `j·rows + i`.
    fn transposed(rows: usize, cols: usize) -> Strided {
        Strided {
            rows,
            cols,
            rs: 1,
            cs: rows,
        }
    }

    /// Elements needed to hold the matrix (0 for an empty one).
    fn span(self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }
}

/// `dst (m, n) = [dst +] lhs (m, k) · rhs (k, n)`, single-threaded, bounds-checked.
fn sgemm(
    dst: &mut [f32],
    d: Strided,
    accumulate: bool,
    lhs: &[f32],
    l: Strided,
    rhs: &[f32],
    r: Strided,
) {
    assert!(
        d.rows == l.rows && d.cols == r.cols && l.cols == r.rows,
        "sgemm: shape mismatch"
    );
    assert!(
        d.span() <= dst.len() && l.span() <= lhs.len() && r.span() <= rhs.len(),
        "sgemm: out of bounds"
    );
    let as_isize = |x: usize| isize::try_from(x).expect("sgemm: stride overflows isize");
    if d.rows == 0 || d.cols == 0 {
        return;
    }
    // SAFETY: the asserts above keep every element gemm touches, at
    // `row·rs + col·cs` for row < rows and col < cols, inside its slice; the
    // strides are nonnegative. `dst` is borrowed `&mut`, so it cannot alias the
    // shared `lhs` and `rhs`. gemm is called with `Parallelism::None`, so it
    // spawns no threads that could outlive the borrows.
    unsafe {
        gemm(
            d.rows,
            d.cols,
            l.cols,
            dst.as_mut_ptr(),
            as_isize(d.cs),
            as_isize(d.rs),
            accumulate,
            lhs.as_ptr(),
            as_isize(l.cs),
            as_isize(l.rs),
            rhs.as_ptr(),
            as_isize(r.cs),
            as_isize(r.rs),
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `out[bt, o] = bias[o] + Σ_c inp[bt, c] · weight[o, c]`.
///
/// The products are summed in `f32` whatever the storage; a bf16 `out` is
/// rounded once.
pub fn matmul_forward<S: Storage>(
    out: &mut [S],      // (B, T, OC)
    inp: &[S],          // (B, T, C)
    weight: &[S],       // (OC, C)
    bias: Option<&[S]>, // (OC)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) {
    matmul_forward_ld(out, inp, weight, bias, b * t, c, oc, oc)
}

/// [`matmul_forward`] into rows `ld` elements apart (module docs).
pub fn matmul_forward_ld<S: Storage>(
    out: &mut [S],      // (N, ld), columns 0..OC written
    inp: &[S],          // (N, C)
    weight: &[S],       // (OC, C)
    bias: Option<&[S]>, // (OC)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) {
    check_stride("matmul_forward", ("OC", oc), ("ld", ld));
    check_len("matmul_forward", "out", out.len(), n * ld);
    check_len("matmul_forward", "inp", inp.len(), n * c);
    check_len("matmul_forward", "weight", weight.len(), oc * c);
    if let Some(bias) = bias {
        check_len("matmul_forward", "bias", bias.len(), oc);
    }
    let inp = S::load_slice(inp);
    let bias = bias.map(S::load_slice);
    S::update_f32(out, |out| {
        if let Some(bias) = &bias {
            for out_bt in out.chunks_exact_mut(ld) {
                out_bt[..oc].copy_from_slice(bias);
            }
        }
        // Output columns o0..o0 + cols from weight rows o0..o0 + cols, given
        // as f32 (weightᵀ: element (c, o) is at o·C + c).
        let product = |out: &mut [f32], o0: usize, cols: usize, weight: &[f32]| {
            sgemm(
                &mut out[o0..],
                Strided::padded(n, cols, ld),
                bias.is_some(),
                &inp,
                Strided::row_major(n, c),
                weight,
                Strided::transposed(c, cols),
            )
        };
        if S::DTYPE == Dtype::F32 || n > FEW_ROWS {
            product(out, 0, oc, &S::load_slice(weight));
            return;
        }
        // A few rows (decoding: one) against a converted weight: widening all
        // of it costs more than the product, and as much memory again as an
        // f32 model. One L2-sized block of weight rows at a time instead.
        let block = (WEIGHT_BLOCK / c.max(1)).clamp(1, oc.max(1));
        let mut wide = vec![0f32; block * c];
        for o0 in (0..oc).step_by(block) {
            let cols = block.min(oc - o0);
            let wide = &mut wide[..cols * c];
            for (w, x) in wide.iter_mut().zip(&weight[o0 * c..(o0 + cols) * c]) {
                *w = x.load();
            }
            product(out, o0, cols, wide);
        }
    });
}

/// [`matmul_forward_ld`] converts a non-`f32` weight block by block, not
/// whole, for at most this many rows of `inp`.
const FEW_ROWS: usize = 8;
/// Elements of the converted weight block (256 KiB of `f32`).
const WEIGHT_BLOCK: usize = 64 * 1024;

/// Accumulates the input gradient: `dinp += dout · weight`.
pub fn matmul_backward_input<S: Storage>(
    dinp: &mut [S], // (B, T, C)
    dout: &[S],     // (B, T, OC)
    weight: &[S],   // (OC, C)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) {
    matmul_backward_input_ld(dinp, dout, weight, b * t, c, oc, oc)
}

/// [`matmul_backward_input`] from `dout` rows `ld` elements apart (module
/// docs).
pub fn matmul_backward_input_ld<S: Storage>(
    dinp: &mut [S], // (N, C)
    dout: &[S],     // (N, ld), columns 0..OC read
    weight: &[S],   // (OC, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) {
    check_stride("matmul_backward_input", ("OC", oc), ("ld", ld));
    check_len("matmul_backward_input", "dinp", dinp.len(), n * c);
    check_len("matmul_backward_input", "dout", dout.len(), n * ld);
    check_len("matmul_backward_input", "weight", weight.len(), oc * c);
    let (dout, weight) = (S::load_slice(dout), S::load_slice(weight));
    S::update_f32(dinp, |dinp| {
        sgemm(
            dinp,
            Strided::row_major(n, c),
            true,
            &dout,
            Strided::padded(n, oc, ld),
            &weight,
            Strided::row_major(oc, c),
        )
    });
}

/// Accumulates the parameter gradients: `dweight += doutᵀ · inp` and, when
/// given, `dbias += Σ_bt dout[bt, :]` (summed in `f32` in the CUDA kernel's
/// lane order, [`BIAS_GRAD_LANES`]; rounded once).
pub fn matmul_backward_weight<S: Storage>(
    dweight: &mut [S],       // (OC, C)
    dbias: Option<&mut [S]>, // (OC)
    dout: &[S],              // (B, T, OC)
    inp: &[S],               // (B, T, C)
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
) {
    matmul_backward_weight_ld(dweight, dbias, dout, inp, b * t, c, oc, oc)
}

/// [`matmul_backward_weight`] from `dout` rows `ld` elements apart (module
/// docs).
pub fn matmul_backward_weight_ld<S: Storage>(
    dweight: &mut [S],       // (OC, C)
    dbias: Option<&mut [S]>, // (OC)
    dout: &[S],              // (N, ld), columns 0..OC read
    inp: &[S],               // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) {
    check_stride("matmul_backward_weight", ("OC", oc), ("ld", ld));
    check_len("matmul_backward_weight", "dweight", dweight.len(), oc * c);
    check_len("matmul_backward_weight", "dout", dout.len(), n * ld);
    check_len("matmul_backward_weight", "inp", inp.len(), n * c);
    if let Some(dbias) = &dbias {
        check_len("matmul_backward_weight", "dbias", dbias.len(), oc);
    }
    let (dout, inp) = (S::load_slice(dout), S::load_slice(inp));
    S::update_f32(dweight, |dweight| {
        weight_gradient_rows(dweight, &dout, &inp, n, c, ld, 0..oc)
    });
    if let Some(dbias) = dbias {
        S::update_f32(dbias, |dbias| bias_gradient(dbias, &dout, n, ld));
    }
}

/// Rows `rows` of [`matmul_backward_weight`]'s `dweight` (no bias):
/// `dweight_rows[o - rows.start, i] += Σ_bt dout[bt, o] · inp[bt, i]` for
/// `o` in `rows`, from the full `dout` `(N, ld)` (`ld = OC`: dense). The same product code as
/// the whole kernel (`weight_gradient_rows`); the library may block a
/// smaller product differently, so a row may differ from the whole kernel's
/// in its last bits.
pub fn matmul_backward_weight_rows<S: Storage>(
    dweight_rows: &mut [S], // (R, C)
    dout: &[S],             // (N, ld)
    inp: &[S],              // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
    rows: std::ops::Range<usize>,
) {
    let name = "matmul_backward_weight_rows";
    assert!(
        rows.start <= rows.end && rows.end <= oc,
        "{name}: rows {rows:?} are not inside 0..{oc}"
    );
    check_stride(name, ("OC", oc), ("ld", ld));
    let r = rows.len();
    check_len(name, "dweight_rows", dweight_rows.len(), r * c);
    check_len(name, "dout", dout.len(), n * ld);
    check_len(name, "inp", inp.len(), n * c);
    if r == 0 || n == 0 {
        return;
    }
    let (dout, inp) = (S::load_slice(dout), S::load_slice(inp));
    S::update_f32(dweight_rows, |dw| {
        weight_gradient_rows(dw, &dout, &inp, n, c, ld, rows)
    });
}

/// Row lanes of the bias gradient (the CPU kernel sums in the CUDA
/// kernel's order: lane `j` takes rows `j, j + L, …`, and the lane sums are
/// added in lane order); `BIAS_GRAD_LANES` in `matmul.cu`, one warp each.
pub const BIAS_GRAD_LANES: usize = 32;

/// `dbias[o] += Σ_n dout[n, o]` in the CUDA kernel's order: lane `j` sums
/// rows `j, j + L, j + 2L, …` (`L` = [`BIAS_GRAD_LANES`]) in order from 0,
/// and `dbias[o]` gets the `L` lane sums added in lane order, all in `f32`.
/// A fixed order for any `N`, parallel on a GPU (one warp per lane, 32
/// channels a block), and cheap here (the lane sums are rows of a `(L, OC)`
/// table, each row added to vectorised).
fn bias_gradient(dbias: &mut [f32], dout: &[f32], n: usize, ld: usize) {
    let oc = dbias.len();
    let mut lanes = vec![0.0f32; BIAS_GRAD_LANES * oc];
    for (r, row) in dout.chunks(ld).take(n).enumerate() {
        let lane = &mut lanes[(r % BIAS_GRAD_LANES) * oc..][..oc];
        for (s, &g) in lane.iter_mut().zip(&row[..oc]) {
            *s += g;
        }
    }
    for lane in lanes.chunks_exact(oc) {
        for (d, &s) in dbias.iter_mut().zip(lane) {
            *d += s;
        }
    }
}

/// The product of both weight-gradient kernels, in `f32`: `dw (R, C) +=`
/// rows `rows` of `doutᵀ (OC, N)` times `inp (N, C)`, `dout`'s rows `ld`
/// elements apart.
fn weight_gradient_rows(
    dw: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    n: usize,
    c: usize,
    ld: usize,
    rows: std::ops::Range<usize>,
) {
    sgemm(
        dw,
        Strided::row_major(rows.len(), c),
        true,
        // doutᵀ's rows `rows`: element (o, bt) is dout[bt·ld + rows.start + o]
        &dout[rows.start..],
        Strided {
            rows: rows.len(),
            cols: n,
            rs: 1,
            cs: ld,
        },
        inp,
        Strided::row_major(n, c),
    )
}

// ---------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------

/// [`matmul_forward_ld`] on the task's stream: the bias is broadcast into
/// `out` first and the cuBLAS product added with `beta = 1`, the CPU
/// kernel's order; or, for bf16 with [`bias_epilogue`] on (and operands that
/// allow it), added in cuBLASLt's epilogue. `ld = OC` for dense rows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,       // (N, ld)
    inp: DevSlice<S>,          // (N, C)
    weight: DevSlice<S>,       // (OC, C)
    bias: Option<DevSlice<S>>, // (OC)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<()> {
    let lt = bias_epilogue()
        && bias
            .as_ref()
            .is_some_and(|b| bias_epilogue_fits::<S>(&out, &inp, &weight, b, c, ld));
    matmul_forward_cuda_with(cu, out, inp, weight, bias, n, c, oc, ld, lt)
}

/// Whether cuBLASLt can run a product with a fused epilogue on these
/// operands: bf16 storage, every pointer in `ptrs` 16-byte aligned, every
/// dimension in `dims` a multiple of 8 elements.
fn epilogue_fits<S: Storage>(ptrs: &[u64], dims: &[usize]) -> bool {
    S::DTYPE == Dtype::Bf16 && ptrs.iter().all(|p| p % 16 == 0) && dims.iter().all(|d| d % 8 == 0)
}

/// Whether a product can take its bias in cuBLASLt's epilogue: bf16, every
/// operand 16-byte aligned, `C` and `ld` multiples of 8 elements.
fn bias_epilogue_fits<S: Storage>(
    out: &DevSliceMut<S>,
    inp: &DevSlice<S>,
    weight: &DevSlice<S>,
    bias: &DevSlice<S>,
    c: usize,
    ld: usize,
) -> bool {
    epilogue_fits::<S>(&[inp.ptr(), weight.ptr(), out.ptr(), bias.ptr()], &[c, ld])
}

/// Whether a product can take its bias and GELU in cuBLASLt's epilogue:
/// as [`bias_epilogue_fits`] (with `ld = OC`), and `pre` 16-byte aligned.
fn gelu_epilogue_fits<S: Storage>(
    out: &DevSliceMut<S>,
    pre: &DevSliceMut<S>,
    inp: &DevSlice<S>,
    weight: &DevSlice<S>,
    bias: &DevSlice<S>,
    c: usize,
    oc: usize,
) -> bool {
    let ptrs = [pre.ptr(), inp.ptr(), weight.ptr(), out.ptr(), bias.ptr()];
    epilogue_fits::<S>(&ptrs, &[c, oc])
}

/// [`matmul_forward_cuda`] with the choice made: `lt` adds the bias in
/// cuBLASLt's epilogue (an error where the operands do not allow it, or
/// without a bias); else the broadcast and `beta = 1`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_cuda_with<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>,       // (N, ld)
    inp: DevSlice<S>,          // (N, C)
    weight: DevSlice<S>,       // (OC, C)
    bias: Option<DevSlice<S>>, // (OC)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
    lt: bool,
) -> Result<()> {
    let k = Check::new("matmul_forward");
    let (ni, oci) = (k.dim("N", n)?, k.dim("OC", oc)?);
    let ldi = k.stride("ld", ld, "OC", oc)?;
    k.dim("C", c)?;
    k.exact("out", &out, "(N, ld)", k.mul(n, ld)?)?;
    k.exact("inp", &inp, "(N, C)", k.mul(n, c)?)?;
    k.exact("weight", &weight, "(OC, C)", k.mul(oc, c)?)?;
    if let Some(bias) = &bias {
        k.exact("bias", bias, "(OC)", oc)?;
    }
    if lt {
        let Some(bias) = bias.filter(|b| bias_epilogue_fits::<S>(&out, &inp, &weight, b, c, ld))
        else {
            return Err(k.err(
                "the bias epilogue needs a bias, bf16 operands aligned to 16 bytes and C, ld \
                 multiples of 8"
                    .into(),
            ));
        };
        let l = Launcher::new(k, cu);
        let mut g = Gemm::new(Transpose::N, Transpose::T, n, oc, c);
        g.ldc = ld;
        // SAFETY: inp (N, C) · weight (OC, C)ᵀ + bias (OC) into columns
        // 0..OC of out (N, ld), sizes checked, all bf16 (S is).
        return unsafe {
            l.gemm_bf16_epilogue(
                &g,
                inp.ptr(),
                weight.ptr(),
                out.ptr(),
                Epilogue::Bias(bias.ptr()),
            )
        };
    }
    let l = Launcher::new(k, cu);
    let beta = if let Some(bias) = bias {
        let mut a = KernelArgs::new();
        a.ptr(out.ptr()).ptr(bias.ptr()).i32(ni).i32(oci).i32(ldi);
        let kernel = by_dtype::<S>(&BIAS_BROADCAST, &BIAS_BROADCAST_BF16);
        // SAFETY: bias_broadcast[_bf16](S* out, const S* bias, int N, int
        // OC, int ld), S the storage type of both; out is (N, ld) with
        // ld >= OC, bias (OC) (checked).
        unsafe { l.launch(kernel, l.linear(n * oc, 256)?, &a)? };
        1.0
    } else {
        0.0
    };
    let mut g = Gemm::new(Transpose::N, Transpose::T, n, oc, c).scaled(1.0, beta);
    g.ldc = ld;
    // SAFETY: inp (N, C) · weight (OC, C)ᵀ into columns 0..OC of out
    // (N, ld), sizes checked, all stored as S.
    unsafe { l.gemm_as::<S>(&g, inp.ptr(), weight.ptr(), out.ptr()) }
}

/// Whether bf16 products with a bias add it in cuBLASLt's epilogue
/// ([`matmul_forward_cuda`]) instead of broadcasting it into the output
/// first and accumulating the product onto it: on unless
/// `BRAID_CUBLASLT_BIAS=0`, read once. The product is then rounded once,
/// not twice, and one pass over the output is saved: GPT-2 124M's fused
/// bf16 step at B 8 ran 0.93× the time with it (docs/gpu-validation.md,
/// run 7).
pub fn bias_epilogue() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(BIAS_EPILOGUE_ENV).is_none_or(|v| v != "0"))
}

/// Whether [`forward_gelu`] takes its GELU in cuBLASLt's epilogue
/// (`GELU_AUX_BIAS`) on CUDA: level 1 or 2 of [`gelu_fusion`]. It saves the
/// GELU kernel's pass over the MLP's activations (0.53 ms of run 7's B 8
/// step on an H200).
pub fn gelu_epilogue(cuda: bool) -> bool {
    gelu_fusion(cuda) >= 1
}

/// Whether the fused model's MLP backward also takes the GELU's gradient in
/// cuBLASLt's epilogue ([`backward_input_dgelu`]): level 2 of
/// [`gelu_fusion`]. It saves the GELU backward kernel (0.67 ms of run 7's
/// step) and a pass over its input.
pub fn dgelu_epilogue(cuda: bool) -> bool {
    gelu_fusion(cuda) >= 2
}

/// How much of the GELU goes into cuBLASLt's epilogues (llm.c's
/// `gelu_fusion` levels: 1 forward, 2 forward and backward):
/// `BRAID_CUBLASLT_GELU` (`0`, `1` or `2`; other values are refused by
/// [`check_environment`](super::switches::check_environment)), read once;
/// unset, 2 for a run on CUDA and 0 on the CPU. Level 2 is the CUDA default
/// since run 8 (docs/gpu-validation.md): GPT-2 124M's fused bf16 step ran
/// 0.97× the time at B 8 and 0.95× at B 64, with the same losses. On the CPU
/// there is no epilogue to fuse into: its tasks stay the reference ones.
pub fn gelu_fusion(cuda: bool) -> u8 {
    static LEVEL: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    let set = *LEVEL.get_or_init(|| match std::env::var_os(GELU_EPILOGUE_ENV) {
        Some(v) if v == "0" => Some(0),
        Some(v) if v == "1" => Some(1),
        Some(v) if v == "2" => Some(2),
        _ => None,
    });
    set.unwrap_or(if cuda { 2 } else { 0 })
}

/// The environment variable of [`gelu_epilogue`].
pub const GELU_EPILOGUE_ENV: &str = "BRAID_CUBLASLT_GELU";

/// [`forward_gelu`] on the task's stream: with `lt`, one cuBLASLt product
/// with the `GELU_AUX_BIAS` epilogue (an error where the operands do not
/// allow it: bf16, 16-byte aligned, `C` and `OC` multiples of 8); else
/// [`matmul_forward_cuda`] then the GELU kernel.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_gelu_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    out: DevSliceMut<S>, // (N, OC)
    pre: DevSliceMut<S>, // (N, OC)
    inp: DevSlice<S>,    // (N, C)
    weight: DevSlice<S>, // (OC, C)
    bias: DevSlice<S>,   // (OC)
    (n, c, oc): (usize, usize, usize),
    lt: bool,
) -> Result<()> {
    if !lt {
        matmul_forward_cuda(cu, pre, inp, weight, Some(bias), n, c, oc, oc)?;
        return super::gelu::gelu_forward_cuda(cu, out, pre.as_read());
    }
    let k = Check::new("matmul_forward_gelu");
    k.dim("N", n)?;
    k.dim("C", c)?;
    k.dim("OC", oc)?;
    let noc = k.mul(n, oc)?;
    k.exact("out", &out, "(N, OC)", noc)?;
    k.exact("pre", &pre, "(N, OC)", noc)?;
    k.exact("inp", &inp, "(N, C)", k.mul(n, c)?)?;
    k.exact("weight", &weight, "(OC, C)", k.mul(oc, c)?)?;
    k.exact("bias", &bias, "(OC)", oc)?;
    if !gelu_epilogue_fits::<S>(&out, &pre, &inp, &weight, &bias, c, oc) {
        return Err(k.err(
            "the GELU epilogue needs bf16 operands aligned to 16 bytes and C, OC multiples of 8"
                .into(),
        ));
    }
    let l = Launcher::new(k, cu);
    let g = Gemm::new(Transpose::N, Transpose::T, n, oc, c);
    // SAFETY: inp (N, C) · weight (OC, C)ᵀ + bias (OC) into pre (N, OC),
    // its GELU into out (N, OC), sizes checked, all bf16 (S is), out and
    // pre distinct declared writes of the task.
    unsafe {
        l.gemm_bf16_epilogue(
            &g,
            inp.ptr(),
            weight.ptr(),
            out.ptr(),
            Epilogue::GeluAuxBias {
                bias: bias.ptr(),
                aux: pre.ptr(),
                ld: oc,
            },
        )
    }
}

/// The environment variable of [`bias_epilogue`].
pub const BIAS_EPILOGUE_ENV: &str = "BRAID_CUBLASLT_BIAS";

/// [`backward_input_dgelu`] on the task's stream: one cuBLASLt product with
/// the `DGELU` epilogue (an error where the operands do not allow it: bf16,
/// 16-byte aligned, `C` and `OC` multiples of 8).
pub fn matmul_backward_input_dgelu_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>, // (N, C) overwritten
    dout: DevSlice<S>,    // (N, OC)
    weight: DevSlice<S>,  // (OC, C)
    pre: DevSlice<S>,     // (N, C)
    (n, c, oc): (usize, usize, usize),
) -> Result<()> {
    let k = Check::new("matmul_backward_input_dgelu");
    k.dim("N", n)?;
    k.dim("C", c)?;
    k.dim("OC", oc)?;
    let nc = k.mul(n, c)?;
    k.exact("dinp", &dinp, "(N, C)", nc)?;
    k.exact("dout", &dout, "(N, OC)", k.mul(n, oc)?)?;
    k.exact("weight", &weight, "(OC, C)", k.mul(oc, c)?)?;
    k.exact("pre", &pre, "(N, C)", nc)?;
    let ptrs = [dinp.ptr(), dout.ptr(), weight.ptr(), pre.ptr()];
    if !epilogue_fits::<S>(&ptrs, &[c, oc]) {
        return Err(k.err(
            "the DGELU epilogue needs bf16 operands aligned to 16 bytes and C, OC multiples of 8"
                .into(),
        ));
    }
    let l = Launcher::new(k, cu);
    let g = Gemm::new(Transpose::N, Transpose::N, n, c, oc).scaled(1.0, 0.0);
    // SAFETY: dout (N, OC) · weight (OC, C) times gelu'(pre (N, C)) into
    // dinp (N, C), sizes checked, all bf16 (S is); dinp a declared write
    // distinct from the reads.
    unsafe {
        l.gemm_bf16_epilogue(
            &g,
            dout.ptr(),
            weight.ptr(),
            dinp.ptr(),
            Epilogue::DGelu {
                aux: pre.ptr(),
                ld: c,
            },
        )
    }
}

/// [`matmul_backward_input_ld`] on the task's stream (cuBLAS, `beta = 1`; `beta =
/// 0` for [`GradWrite::Set`]).
pub fn matmul_backward_input_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dinp: DevSliceMut<S>, // (N, C) accumulated or overwritten
    write: GradWrite,
    dout: DevSlice<S>,   // (N, ld)
    weight: DevSlice<S>, // (OC, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<()> {
    let k = Check::new("matmul_backward_input");
    k.dim("N", n)?;
    k.dim("C", c)?;
    k.dim("OC", oc)?;
    k.stride("ld", ld, "OC", oc)?;
    k.exact("dinp", &dinp, "(N, C)", k.mul(n, c)?)?;
    k.exact("dout", &dout, "(N, ld)", k.mul(n, ld)?)?;
    k.exact("weight", &weight, "(OC, C)", k.mul(oc, c)?)?;
    let l = Launcher::new(k, cu);
    // beta 0 does not read dinp (cuBLAS: C need not be valid then).
    let beta = if write == GradWrite::Set { 0.0 } else { 1.0 };
    let mut g = Gemm::new(Transpose::N, Transpose::N, n, c, oc).scaled(1.0, beta);
    g.lda = ld;
    // SAFETY: columns 0..OC of dout (N, ld) · weight (OC, C) added to (or
    // written over) dinp (N, C), sizes checked, all stored as S.
    unsafe { l.gemm_as::<S>(&g, dout.ptr(), weight.ptr(), dinp.ptr()) }
}

/// [`matmul_backward_weight_ld`] on the task's stream: `dweight += doutᵀ ·
/// inp` (cuBLAS, `beta = 1`) and, with `dbias`, `dbias += Σ_rows dout` (one
/// thread per channel, rows in order).
pub fn matmul_backward_weight_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dweight: DevSliceMut<S>,       // (OC, C) accumulated
    dbias: Option<DevSliceMut<S>>, // (OC) accumulated
    dout: DevSlice<S>,             // (N, ld)
    inp: DevSlice<S>,              // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
) -> Result<()> {
    let k = Check::new("matmul_backward_weight");
    let (ni, oci) = (k.dim("N", n)?, k.dim("OC", oc)?);
    let ldi = k.stride("ld", ld, "OC", oc)?;
    k.dim("C", c)?;
    k.exact("dweight", &dweight, "(OC, C)", k.mul(oc, c)?)?;
    if let Some(dbias) = &dbias {
        k.exact("dbias", dbias, "(OC)", oc)?;
    }
    k.exact("dout", &dout, "(N, ld)", k.mul(n, ld)?)?;
    k.exact("inp", &inp, "(N, C)", k.mul(n, c)?)?;
    let l = Launcher::new(k, cu);
    let mut g = Gemm::new(Transpose::T, Transpose::N, oc, c, n).scaled(1.0, 1.0);
    g.lda = ld;
    // SAFETY: columns 0..OC of dout (N, ld), transposed, · inp (N, C) added
    // to dweight (OC, C), sizes checked, all stored as S.
    unsafe { l.gemm_as::<S>(&g, dout.ptr(), inp.ptr(), dweight.ptr())? };
    if let Some(dbias) = dbias {
        let mut a = KernelArgs::new();
        a.ptr(dbias.ptr()).ptr(dout.ptr()).i32(ni).i32(oci).i32(ldi);
        let kernel = by_dtype::<S>(&BIAS_BACKWARD, &BIAS_BACKWARD_BF16);
        // One block of BIAS_GRAD_LANES warps per 32 channels.
        let block = (32 * BIAS_GRAD_LANES) as u32;
        let cfg = LaunchConfig::grid_block(l.grid(oc.div_ceil(32))?, block);
        // SAFETY: bias_backward[_bf16](S* dbias, const S* dout, int N, int
        // OC, int ld), S the storage type of both; dbias (OC), dout (N, ld)
        // with ld >= OC (checked).
        unsafe { l.launch(kernel, cfg, &a)? };
    }
    Ok(())
}

/// [`matmul_backward_weight_rows`] on the task's stream through cuBLAS:
/// columns `rows` of `dout (N, ld)` are a matrix of leading dimension `ld`
/// starting `rows.start` elements in, so the product is one GEMM of `R`
/// output rows, as [`matmul_backward_weight_cuda`]'s is of `OC`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_weight_rows_cuda<S: Storage>(
    cu: &CudaTaskCtx<'_>,
    dweight_rows: DevSliceMut<S>, // (R, C) accumulated
    dout: DevSlice<S>,            // (N, ld)
    inp: DevSlice<S>,             // (N, C)
    n: usize,
    c: usize,
    oc: usize,
    ld: usize,
    rows: std::ops::Range<usize>,
) -> Result<()> {
    let k = Check::new("matmul_backward_weight_rows");
    k.dim("N", n)?;
    k.dim("C", c)?;
    k.stride("ld", ld, "OC", oc)?;
    if rows.start > rows.end || rows.end > oc {
        return Err(k.err(format!("rows {rows:?} are not rows of the {oc} outputs")));
    }
    let r = rows.len();
    k.exact("dweight_rows", &dweight_rows, "(R, C)", k.mul(r, c)?)?;
    k.exact("dout", &dout, "(N, ld)", k.mul(n, ld)?)?;
    k.exact("inp", &inp, "(N, C)", k.mul(n, c)?)?;
    if r == 0 {
        return Ok(());
    }
    let l = Launcher::new(k, cu);
    let mut g = Gemm::new(Transpose::T, Transpose::N, r, c, n).scaled(1.0, 1.0);
    g.lda = ld;
    let first = dout.ptr() + (rows.start * std::mem::size_of::<S>()) as u64;
    // SAFETY: columns rows of dout (N, ld) — R columns from `first`, ld
    // apart, rows.end <= OC <= ld (checked) — transposed, · inp (N, C)
    // added to dweight_rows (R, C), sizes checked, all stored as S.
    unsafe { l.gemm_as::<S>(&g, first, inp.ptr(), dweight_rows.ptr()) }
}

#[cfg(test)]
mod tests {
    use super::super::storage::Bf16;
    use super::super::testutil::{assert_close, randn};
    use super::*;

    /// Row blocks of the weight gradient (uneven, one empty) together are
    /// the whole kernel's, accumulated onto a nonzero start.
    #[test]
    fn weight_gradient_rows_tile_the_whole() {
        let (n, c, oc) = (13, 6, 11);
        let dout = randn(n * oc, 1.0, 60);
        let inp = randn(n * c, 1.0, 61);
        let start = randn(oc * c, 0.5, 62);
        let mut whole = start.clone();
        matmul_backward_weight(&mut whole, None, &dout, &inp, 1, n, c, oc);
        let mut blocks = start.clone();
        for rows in [0..3, 3..3, 3..10, 10..11] {
            let dw = &mut blocks[rows.start * c..rows.end * c];
            matmul_backward_weight_rows(dw, &dout, &inp, n, c, oc, oc, rows.clone());
        }
        assert_close(&blocks, &whole, 1e-6, 1e-5, "row blocks vs whole");
        assert_ne!(blocks, start);
    }

    /// The bias gradient in lane order against an `f64` sum, for fewer rows
    /// than lanes, more, and padded rows (whose padding is never read).
    #[test]
    fn bias_gradient_sums_every_row_once() {
        for (n, oc, ld) in [(5, 7, 7), (100, 9, 9), (77, 6, 11)] {
            let mut dout = randn(n * ld, 1.0, 70 + n as u64);
            for row in dout.chunks_mut(ld) {
                row[oc..].fill(f32::NAN);
            }
            let start = randn(oc, 0.5, 71);
            let mut dbias = start.clone();
            bias_gradient(&mut dbias, &dout, n, ld);
            let want: Vec<f32> = (0..oc)
                .map(|o| {
                    let s: f64 = (0..n).map(|r| dout[r * ld + o] as f64).sum();
                    (start[o] as f64 + s) as f32
                })
                .collect();
            assert_close(
                &dbias,
                &want,
                1e-5,
                1e-5,
                &format!("n {n}, oc {oc}, ld {ld}"),
            );
        }
    }

    #[test]
    #[should_panic(expected = "not inside 0..11")]
    fn weight_gradient_rows_past_oc_are_refused() {
        let (n, c, oc) = (2, 3, 11);
        let mut dw = vec![0.0f32; 2 * c];
        matmul_backward_weight_rows(&mut dw, &[0.0; 22], &[0.0; 6], n, c, oc, oc, 10..12);
    }

    /// A few bf16 rows (the weight widened block by block: three blocks,
    /// the last short) give the f32 kernel's result on the widened
    /// operands, rounded once, into padded rows (bias or not). Columns
    /// past OC keep what they held.
    #[test]
    fn few_bf16_rows_take_the_weight_in_blocks() {
        let (c, oc, ld) = (300, 500, 512);
        assert!(oc * c > 2 * WEIGHT_BLOCK && oc % (WEIGHT_BLOCK / c) != 0);
        let bf = |v: Vec<f32>| v.into_iter().map(Bf16::store).collect::<Vec<_>>();
        let wide = |v: &[Bf16]| v.iter().map(|x| x.load()).collect::<Vec<_>>();
        let weight = bf(randn(oc * c, 1.0, 30));
        let bias = bf(randn(oc, 1.0, 31));
        for n in [1, FEW_ROWS] {
            let inp = bf(randn(n * c, 1.0, 32));
            for bias in [None, Some(&bias[..])] {
                let mut want = vec![7.0f32; n * ld];
                let wide_bias = bias.map(wide);
                matmul_forward_ld(
                    &mut want,
                    &wide(&inp),
                    &wide(&weight),
                    wide_bias.as_deref(),
                    n,
                    c,
                    oc,
                    ld,
                );
                let mut out = vec![Bf16::store(7.0); n * ld];
                matmul_forward_ld(&mut out, &inp, &weight, bias, n, c, oc, ld);
                assert_eq!(
                    wide(&out),
                    wide(&bf(want)),
                    "n {n}, bias {}",
                    bias.is_some()
                );
            }
        }
    }

    /// The naive triple loop, in f64.
    fn naive_forward(
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Vec<f32> {
        let mut out = vec![0.0; n * oc];
        for r in 0..n {
            for o in 0..oc {
                let mut acc = bias.map_or(0.0, |bb| bb[o] as f64);
                for i in 0..c {
                    acc += inp[r * c + i] as f64 * weight[o * c + i] as f64;
                }
                out[r * oc + o] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn matmul_forward_and_backward_match_naive_loops() {
        let (b, t, c, oc) = (2, 5, 7, 11);
        let n = b * t;
        let inp = randn(n * c, 1.0, 20);
        let weight = randn(oc * c, 1.0, 21);
        let bias = randn(oc, 1.0, 22);
        let mut out = vec![f32::NAN; n * oc];
        matmul_forward(&mut out, &inp, &weight, Some(&bias), b, t, c, oc);
        assert_close(
            &out,
            &naive_forward(&inp, &weight, Some(&bias), n, c, oc),
            1e-5,
            1e-5,
            "fwd",
        );
        // Without bias the old contents of `out` must be ignored.
        matmul_forward(&mut out, &inp, &weight, None, b, t, c, oc);
        assert_close(
            &out,
            &naive_forward(&inp, &weight, None, n, c, oc),
            1e-5,
            1e-5,
            "fwd nobias",
        );

        let dout = randn(n * oc, 1.0, 23);
        let prior = randn(n * c, 1.0, 24);
        let mut dinp = prior.clone();
        matmul_backward_input(&mut dinp, &dout, &weight, b, t, c, oc);
        let mut want = prior.clone();
        for r in 0..n {
            for i in 0..c {
                let s: f64 = (0..oc)
                    .map(|o| dout[r * oc + o] as f64 * weight[o * c + i] as f64)
                    .sum();
                want[r * c + i] += s as f32;
            }
        }
        assert_close(&dinp, &want, 1e-5, 1e-5, "dinp (accumulated)");

        let wprior = randn(oc * c, 1.0, 25);
        let mut dweight = wprior.clone();
        let mut dbias = vec![1.0; oc];
        matmul_backward_weight(&mut dweight, Some(&mut dbias), &dout, &inp, b, t, c, oc);
        let mut want = wprior.clone();
        for o in 0..oc {
            for i in 0..c {
                let s: f64 = (0..n)
                    .map(|r| dout[r * oc + o] as f64 * inp[r * c + i] as f64)
                    .sum();
                want[o * c + i] += s as f32;
            }
        }
        assert_close(&dweight, &want, 1e-5, 1e-5, "dweight (accumulated)");
        let want_b: Vec<f32> = (0..oc)
            .map(|o| 1.0 + (0..n).map(|r| dout[r * oc + o]).sum::<f32>())
            .collect();
        assert_close(&dbias, &want_b, 1e-5, 1e-5, "dbias (accumulated)");
    }
}
