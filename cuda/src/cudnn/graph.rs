//! The operation graphs of causal attention, as cuDNN's engines match them.
//!
//! cuDNN's flash-attention engines are found by pattern: the graph must be
//! the one NVIDIA's cudnn-frontend builds (its `CompositeSDPANode`,
//! `CompositeSDPABackwardNode` and `UnifiedSDPANode`), operation for
//! operation, with the same virtual tensors and data types. These builders
//! make those graphs for one case only: bf16 Q, K, V in GPT-2's fused `qkv`
//! layout, a causal (top-left) mask, a by-value scale, softmax statistics
//! out of the forward, no dropout, bias or padding, and the deterministic
//! backward (no atomics: dQ is one product, as llm.c asks for).
//!
//! * [`GraphKind::Composite`]: matmuls, pointwise operations and reductions;
//!   the causal mask from two index generators, a comparison and a select.
//!   What the frontend builds for every cuDNN 9 release before 9.21.
//! * [`GraphKind::Band`]: the same graph with the mask as one
//!   diagonal-band-mask operation and the forward's softmax as one softmax
//!   operation (cuDNN 9.21 on).
//! * [`GraphKind::Unified`] (forward only): one SDPA operation with the mask
//!   in a subgraph (cuDNN 9.21 on; 9.13 added the operation, but a causal
//!   mask on it needs 9.21). Its backward needs cuDNN 9.28 for a causal
//!   mask, so a backward is never unified here.

use cudarc::cudnn::sys;

use super::backend::{Desc, RawHandle, Value};
use super::{Direction, SdpaShape};
use crate::error::{CudaError, CudaResult};
use crate::memory::DevicePtr;

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendDescriptorType_t as D;
use sys::cudnnDataType_t as Dt;
use sys::cudnnPointwiseMode_t as Pw;

/// One way to describe the attention to cuDNN (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GraphKind {
    /// One SDPA operation, the mask in a subgraph (forward, cuDNN ≥ 9.21).
    Unified,
    /// Matmuls, pointwise operations and reductions (cuDNN ≥ 9.0).
    Composite,
    /// The composite graph with cuDNN 9.21's band-mask and softmax
    /// operations.
    Band,
}

impl GraphKind {
    /// `"unified"`, `"composite"` or `"band"`.
    pub fn name(self) -> &'static str {
        match self {
            GraphKind::Unified => "unified",
            GraphKind::Composite => "composite",
            GraphKind::Band => "band",
        }
    }

    /// Whether cuDNN `version` (e.g. 92100) has what this kind needs for
    /// `direction`.
    pub(super) fn available(self, version: usize, direction: Direction) -> bool {
        match (self, direction) {
            (GraphKind::Unified, Direction::Forward) => version >= 92100,
            (GraphKind::Unified, Direction::Backward) => false,
            (GraphKind::Band, _) => version >= 92100,
            (GraphKind::Composite, _) => true,
        }
    }
}

// Unique ids of the tensors a call binds (non-virtual); virtual tensors
// are numbered from `FIRST_VIRTUAL`.
pub(super) const UID_Q: i64 = 1;
pub(super) const UID_K: i64 = 2;
pub(super) const UID_V: i64 = 3;
pub(super) const UID_O: i64 = 4;
pub(super) const UID_STATS: i64 = 5;
pub(super) const UID_SCALE: i64 = 6;
const UID_NEG: i64 = 7;
const UID_ONE: i64 = 8;
pub(super) const UID_DO: i64 = 9;
pub(super) const UID_DQ: i64 = 10;
pub(super) const UID_DK: i64 = 11;
pub(super) const UID_DV: i64 = 12;
const UID_SOFTMAX_SUM: i64 = 13;
const FIRST_VIRTUAL: i64 = 100;

/// A finalized operation graph and what running it needs besides the
/// caller's tensors.
pub(super) struct Built {
    pub(super) graph: Desc,
    /// The tensors and operations the graph refers to.
    pub(super) keep: Vec<Desc>,
    /// By-value scalars: `(uid, value)`, bound to host memory at each call.
    pub(super) scalars: Vec<(i64, f32)>,
    /// Tensors the graph keeps in the workspace, before cuDNN's own part:
    /// `(uid, bytes)`, laid out in order, each 256-byte aligned.
    pub(super) scratch: Vec<(i64, usize)>,
}

/// The caller's tensors of a forward call: `(uid, address)`.
pub(super) fn forward_pointers(
    q: DevicePtr,
    k: DevicePtr,
    v: DevicePtr,
    o: DevicePtr,
    stats: DevicePtr,
) -> Vec<(i64, DevicePtr)> {
    vec![
        (UID_Q, q),
        (UID_K, k),
        (UID_V, v),
        (UID_O, o),
        (UID_STATS, stats),
    ]
}

/// The caller's tensors of a backward call.
pub(super) struct BackwardPointers {
    pub(super) q: DevicePtr,
    pub(super) k: DevicePtr,
    pub(super) v: DevicePtr,
    pub(super) o: DevicePtr,
    pub(super) d_o: DevicePtr,
    pub(super) stats: DevicePtr,
    pub(super) dq: DevicePtr,
    pub(super) dk: DevicePtr,
    pub(super) dv: DevicePtr,
}

/// The caller's tensors of a backward call: `(uid, address)`.
pub(super) fn backward_pointers(p: BackwardPointers) -> Vec<(i64, DevicePtr)> {
    vec![
        (UID_Q, p.q),
        (UID_K, p.k),
        (UID_V, p.v),
        (UID_O, p.o),
        (UID_DO, p.d_o),
        (UID_STATS, p.stats),
        (UID_DQ, p.dq),
        (UID_DK, p.dk),
        (UID_DV, p.dv),
    ]
}

/// Builds and finalizes `direction`'s graph of kind `kind` for `shape`.
pub(super) fn build(
    handle: RawHandle,
    shape: SdpaShape,
    direction: Direction,
    kind: GraphKind,
    version: usize,
) -> CudaResult<Built> {
    if !kind.available(version, direction) {
        return Err(CudaError::InvalidArgument(format!(
            "not offered by cuDNN {}",
            super::version_string(version)
        )));
    }
    let mut g = Builder::new(shape, version);
    match (direction, kind) {
        (Direction::Forward, GraphKind::Unified) => g.unified_forward()?,
        (Direction::Forward, _) => g.composite_forward(kind == GraphKind::Band)?,
        (Direction::Backward, _) => g.composite_backward(kind == GraphKind::Band)?,
    }
    g.finish(handle)
}

/// Dimensions and strides of a rank-4 tensor.
type Layout = ([i64; 4], [i64; 4]);

/// Makes the tensors and operations of one graph.
struct Builder {
    s: SdpaShape,
    version: usize,
    /// Operations, in the graph's order.
    ops: Vec<Desc>,
    /// Tensors and inner descriptors the operations refer to.
    keep: Vec<Desc>,
    scalars: Vec<(i64, f32)>,
    scratch: Vec<(i64, usize)>,
    next_virtual: i64,
}

/// A tensor made by a [`Builder`], by its index in `keep`.
#[derive(Clone, Copy)]
struct T(usize);

impl Builder {
    fn new(s: SdpaShape, version: usize) -> Self {
        Builder {
            s,
            version,
            ops: Vec::new(),
            keep: Vec::new(),
            scalars: Vec::new(),
            scratch: Vec::new(),
            next_virtual: FIRST_VIRTUAL,
        }
    }

    fn dims(&self) -> (i64, i64, i64, i64) {
        let s = self.s;
        (s.b as i64, s.nh as i64, s.t as i64, s.hs as i64)
    }

    /// Q, K or V (or their gradients) in `qkv`'s layout: `[B, NH, T, HS]`.
    fn qkv_layout(&self) -> Layout {
        let (b, h, t, d) = self.dims();
        let c = h * d;
        ([b, h, t, d], [3 * t * c, d, 3 * c, 1])
    }

    /// K or V transposed, a view of the same memory: `[B, NH, HS, T]`.
    fn qkv_transposed(&self) -> Layout {
        let ([b, h, t, d], [sb, sh, st, sd]) = self.qkv_layout();
        ([b, h, d, t], [sb, sh, sd, st])
    }

    /// The output and its gradient: `[B, NH, T, HS]` of `(B, T, NH, HS)`.
    fn out_layout(&self) -> Layout {
        let (b, h, t, d) = self.dims();
        ([b, h, t, d], [t * h * d, d, h * d, 1])
    }

    /// Scores: `[B, NH, T, T]`, packed.
    fn scores(&self) -> Layout {
        let (b, h, t, _) = self.dims();
        ([b, h, t, t], [h * t * t, t * t, t, 1])
    }

    /// Scores transposed: the same elements, `[B, NH, T, T]` column-major.
    fn scores_transposed(&self) -> Layout {
        let (b, h, t, _) = self.dims();
        ([b, h, t, t], [h * t * t, t * t, 1, t])
    }

    /// One value per row: `[B, NH, T, 1]`, packed (statistics must be).
    fn rows(&self) -> Layout {
        let (b, h, t, _) = self.dims();
        ([b, h, t, 1], [h * t, t, 1, 1])
    }

    fn tensor(
        &mut self,
        uid: i64,
        dt: Dt,
        (dims, strides): Layout,
        virt: bool,
        by_value: bool,
    ) -> CudaResult<T> {
        let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE as u32, Value::data_type(dt))?
            .set(A::CUDNN_ATTR_TENSOR_DIMENSIONS as u32, Value::I64(&dims))?
            .set(A::CUDNN_ATTR_TENSOR_STRIDES as u32, Value::I64(&strides))?
            .set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID as u32, Value::I64(&[uid]))?
            .set(
                A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT as u32,
                Value::I64(&[16]),
            )?;
        if virt {
            d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL as u32, Value::Bool(true))?;
        }
        if by_value {
            d.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE as u32, Value::Bool(true))?;
        }
        let d = d.finalize(&format!("tensor {uid}"))?;
        self.keep.push(d);
        Ok(T(self.keep.len() - 1))
    }

    /// A bound tensor (in the variant pack).
    fn real(&mut self, uid: i64, dt: Dt, layout: Layout) -> CudaResult<T> {
        self.tensor(uid, dt, layout, false, false)
    }

    /// An intermediate tensor.
    fn virt(&mut self, dt: Dt, layout: Layout) -> CudaResult<T> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(uid, dt, layout, true, false)
    }

    /// A by-value f32 scalar.
    fn scalar(&mut self, uid: i64, value: f32) -> CudaResult<T> {
        self.scalars.push((uid, value));
        self.tensor(uid, Dt::CUDNN_DATA_FLOAT, ([1; 4], [1; 4]), false, true)
    }

    /// A tensor of the workspace, before cuDNN's own part.
    fn scratch(&mut self, uid: i64, dt: Dt, layout: Layout, bytes: usize) -> CudaResult<T> {
        self.scratch.push((uid, bytes));
        self.real(uid, dt, layout)
    }

    fn t(&self, t: T) -> &Desc {
        &self.keep[t.0]
    }

    /// The fill of masked scores: -inf (what the frontend uses from 9.10;
    /// no row is all masked, since the diagonal never is).
    fn neg(&mut self) -> CudaResult<T> {
        let v = if self.version >= 91000 {
            f32::NEG_INFINITY
        } else {
            f32::MIN
        };
        self.scalar(UID_NEG, v)
    }

    fn op(&mut self, op: Desc, what: &str) -> CudaResult<()> {
        let op = op.finalize(what)?;
        self.ops.push(op);
        Ok(())
    }

    /// `y = mode(x[, b[, t]])` (`ins` is `[x]`, `[x, b]` or `[x, b, t]`)
    /// with `prec` as the math precision.
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        ins: &[T],
        y: T,
        axis: Option<i64>,
    ) -> CudaResult<()> {
        let (x, b, t) = (ins[0], ins.get(1).copied(), ins.get(2).copied());
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(A::CUDNN_ATTR_POINTWISE_MODE as u32, Value::pointwise(mode))?
            .set(
                A::CUDNN_ATTR_POINTWISE_MATH_PREC as u32,
                Value::data_type(prec),
            )?;
        if let Some(axis) = axis {
            pw.set(A::CUDNN_ATTR_POINTWISE_AXIS as u32, Value::I64(&[axis]))?;
        }
        let pw = pw.finalize(&format!("pointwise {mode:?}"))?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR as u32,
            Value::Descs(&[&pw]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC as u32,
            Value::Descs(&[self.t(x)]),
        )?;
        if let Some(b) = b {
            op.set(
                A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC as u32,
                Value::Descs(&[self.t(b)]),
            )?;
        }
        if let Some(t) = t {
            op.set(
                A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC as u32,
                Value::Descs(&[self.t(t)]),
            )?;
        }
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC as u32,
            Value::Descs(&[self.t(y)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1 as u32,
            Value::F32(1.0),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2 as u32,
            Value::F32(1.0),
        )?;
        self.keep.push(pw);
        self.op(op, &format!("pointwise operation {mode:?}"))
    }

    /// `y = x ∘ b` in f32.
    fn binary(&mut self, mode: Pw, x: T, b: T, y: T) -> CudaResult<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, &[x, b], y, None)
    }

    /// `y = mode(x)` in f32.
    fn unary(&mut self, mode: Pw, x: T, y: T) -> CudaResult<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, &[x], y, None)
    }

    /// `c = a · b` over the last two dimensions, f32 accumulation.
    fn matmul(&mut self, a: T, b: T, c: T) -> CudaResult<()> {
        let m = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        m.set(
            A::CUDNN_ATTR_MATMUL_COMP_TYPE as u32,
            Value::data_type(Dt::CUDNN_DATA_FLOAT),
        )?;
        let m = m.finalize("matmul")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set(
            A::CUDNN_ATTR_OPERATION_MATMUL_ADESC as u32,
            Value::Descs(&[self.t(a)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_MATMUL_BDESC as u32,
            Value::Descs(&[self.t(b)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_MATMUL_CDESC as u32,
            Value::Descs(&[self.t(c)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_MATMUL_DESC as u32,
            Value::Descs(&[&m]),
        )?;
        self.keep.push(m);
        self.op(op, "matmul operation")
    }

    /// `y` = `x` reduced over its last dimension (`y`'s is 1).
    fn reduce(&mut self, how: sys::cudnnReduceTensorOp_t, x: T, y: T) -> CudaResult<()> {
        let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_OPERATOR as u32,
            Value::reduction(how),
        )?
        .set(
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE as u32,
            Value::data_type(Dt::CUDNN_DATA_FLOAT),
        )?;
        if self.version >= 91100 {
            r.set(
                A::CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC as u32,
                Value::Bool(false),
            )?;
        }
        let r = r.finalize(&format!("reduction {how:?}"))?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set(
            A::CUDNN_ATTR_OPERATION_REDUCTION_DESC as u32,
            Value::Descs(&[&r]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC as u32,
            Value::Descs(&[self.t(x)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC as u32,
            Value::Descs(&[self.t(y)]),
        )?;
        self.keep.push(r);
        self.op(op, &format!("reduction operation {how:?}"))
    }

    /// `y` = `x` with other dimensions or strides (a transpose).
    fn reshape(&mut self, x: T, y: T) -> CudaResult<()> {
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set(
            A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC as u32,
            Value::Descs(&[self.t(x)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC as u32,
            Value::Descs(&[self.t(y)]),
        )?;
        self.op(op, "reshape operation")
    }

    /// The causal mask of scores `x` (f32, packed): the scores where the
    /// row (query) is at or after the column (key), `neg` elsewhere. As
    /// index generators, a comparison and a select, or (`band`) as cuDNN
    /// 9.21's one band-mask operation.
    fn causal(&mut self, x: T, neg: T, band: bool) -> CudaResult<T> {
        let sc = self.scores();
        let y = self.virt(Dt::CUDNN_DATA_FLOAT, sc)?;
        if band {
            let op = Desc::new(D::CUDNN_BACKEND_OPERATION_DIAGONAL_BAND_MASK_DESCRIPTOR)?;
            op.set(
                A::CUDNN_ATTR_OPERATION_DIAGONAL_BAND_MASK_XDESC as u32,
                Value::Descs(&[self.t(x)]),
            )?
            .set(
                A::CUDNN_ATTR_OPERATION_DIAGONAL_BAND_MASK_BDESC as u32,
                Value::Descs(&[self.t(neg)]),
            )?
            .set(
                A::CUDNN_ATTR_OPERATION_DIAGONAL_BAND_MASK_YDESC as u32,
                Value::Descs(&[self.t(y)]),
            )?
            .set(
                A::CUDNN_ATTR_OPERATION_DIAGONAL_BAND_MASK_COMPARISON_MODE as u32,
                Value::pointwise(Pw::CUDNN_POINTWISE_CMP_GE),
            )?;
            self.op(op, "diagonal band mask")?;
            return Ok(y);
        }
        let (row, col) = (
            self.virt(Dt::CUDNN_DATA_INT32, sc)?,
            self.virt(Dt::CUDNN_DATA_INT32, sc)?,
        );
        // The index generators compute in the graph's f32, as today's
        // frontend leaves them (its `CompositeDiagonalBandMaskNode`, for
        // every cuDNN before 9.21); frontends before it asked for int32
        // there. Their outputs are int32 either way.
        let f32_ = Dt::CUDNN_DATA_FLOAT;
        use Pw::{CUDNN_POINTWISE_CMP_GE as GE, CUDNN_POINTWISE_GEN_INDEX as INDEX};
        self.pointwise(INDEX, f32_, &[x], row, Some(2))?;
        self.pointwise(INDEX, f32_, &[x], col, Some(3))?;
        let keep = self.virt(Dt::CUDNN_DATA_BOOLEAN, sc)?;
        self.pointwise(GE, Dt::CUDNN_DATA_BOOLEAN, &[row, col], keep, None)?;
        // y = keep ? x : neg
        let select = Pw::CUDNN_POINTWISE_BINARY_SELECT;
        self.pointwise(select, f32_, &[x, neg, keep], y, None)?;
        Ok(y)
    }

    /// Q·Kᵀ times the scale, masked: the forward's first half and the
    /// backward's recomputation.
    fn masked_scores(&mut self, q: T, kt: T, scale: T, neg: T, band: bool) -> CudaResult<T> {
        let sc = self.scores();
        let s = self.virt(Dt::CUDNN_DATA_FLOAT, sc)?;
        self.matmul(q, kt, s)?;
        let s1 = self.virt(Dt::CUDNN_DATA_FLOAT, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, s, scale, s1)?;
        self.causal(s1, neg, band)
    }

    /// cudnn-frontend's composite forward with statistics (its
    /// `CompositeSDPANode`): S = Q·Kᵀ, scaled, masked; the softmax as max,
    /// subtract, exp, sum, log, add (statistics) and divide (P, bf16), or
    /// (`band`) one softmax operation; O = P·V.
    fn composite_forward(&mut self, band: bool) -> CudaResult<()> {
        let (qkv, qkv_t, out, sc, rows) = (
            self.qkv_layout(),
            self.qkv_transposed(),
            self.out_layout(),
            self.scores(),
            self.rows(),
        );
        let bf = Dt::CUDNN_DATA_BFLOAT16;
        let f = Dt::CUDNN_DATA_FLOAT;
        let q = self.real(UID_Q, bf, qkv)?;
        let kt = self.real(UID_K, bf, qkv_t)?;
        let v = self.real(UID_V, bf, qkv)?;
        let o = self.real(UID_O, bf, out)?;
        let stats = self.real(UID_STATS, f, rows)?;
        let scale = self.scalar(UID_SCALE, 1.0 / (self.s.hs as f32).sqrt())?;
        let neg = self.neg()?;
        let s2 = self.masked_scores(q, kt, scale, neg, band)?;
        let p = self.virt(bf, sc)?;
        if band {
            let op = Desc::new(D::CUDNN_BACKEND_OPERATION_SOFTMAX_DESCRIPTOR)?;
            op.set(
                A::CUDNN_ATTR_OPERATION_SOFTMAX_XDESC as u32,
                Value::Descs(&[self.t(s2)]),
            )?
            .set(
                A::CUDNN_ATTR_OPERATION_SOFTMAX_YDESC as u32,
                Value::Descs(&[self.t(p)]),
            )?
            .set(
                A::CUDNN_ATTR_OPERATION_SOFTMAX_STATS_DESC as u32,
                Value::Descs(&[self.t(stats)]),
            )?;
            self.op(op, "softmax")?;
        } else {
            use sys::cudnnReduceTensorOp_t as R;
            let m = self.virt(f, rows)?;
            self.reduce(R::CUDNN_REDUCE_TENSOR_MAX, s2, m)?;
            let z = self.virt(f, sc)?;
            self.binary(Pw::CUDNN_POINTWISE_SUB, s2, m, z)?;
            let e = self.virt(f, sc)?;
            self.unary(Pw::CUDNN_POINTWISE_EXP, z, e)?;
            let sum = self.virt(f, rows)?;
            self.reduce(R::CUDNN_REDUCE_TENSOR_ADD, e, sum)?;
            let l = self.virt(f, rows)?;
            self.unary(Pw::CUDNN_POINTWISE_LOG, sum, l)?;
            self.binary(Pw::CUDNN_POINTWISE_ADD, m, l, stats)?;
            self.binary(Pw::CUDNN_POINTWISE_DIV, e, sum, p)?;
        }
        self.matmul(p, v, o)
    }

    /// cuDNN 9.21's one SDPA operation (the frontend's `UnifiedSDPANode`):
    /// Q, K, V untransposed, the statistics, and the causal mask as a
    /// subgraph of one band-mask operation from its input scores to its
    /// output.
    fn unified_forward(&mut self) -> CudaResult<()> {
        let (qkv, out, sc, rows) = (
            self.qkv_layout(),
            self.out_layout(),
            self.scores(),
            self.rows(),
        );
        let bf = Dt::CUDNN_DATA_BFLOAT16;
        let q = self.real(UID_Q, bf, qkv)?;
        let k = self.real(UID_K, bf, qkv)?;
        let v = self.real(UID_V, bf, qkv)?;
        let o = self.real(UID_O, bf, out)?;
        let stats = self.real(UID_STATS, Dt::CUDNN_DATA_FLOAT, rows)?;
        let scale = self.scalar(UID_SCALE, 1.0 / (self.s.hs as f32).sqrt())?;
        let neg = self.neg()?;
        // The mask's subgraph: its own operation graph, with no handle.
        let sub_in = self.virt(Dt::CUDNN_DATA_FLOAT, sc)?;
        let in_uid = self.next_virtual - 1;
        let ops_before = self.ops.len();
        let sub_out = self.causal(sub_in, neg, true)?;
        let out_uid = self.next_virtual - 1;
        let mask_ops: Vec<Desc> = self.ops.drain(ops_before..).collect();
        let sub = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        let refs: Vec<&Desc> = mask_ops.iter().collect();
        sub.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS as u32, Value::Descs(&refs))?;
        let sub = sub.finalize("the causal mask's subgraph")?;
        let _ = sub_out;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR)?;
        op.set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC as u32,
            Value::Descs(&[self.t(q)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC as u32,
            Value::Descs(&[self.t(k)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC as u32,
            Value::Descs(&[self.t(v)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC as u32,
            Value::Descs(&[self.t(o)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC as u32,
            Value::Descs(&[self.t(stats)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC as u32,
            Value::Descs(&[self.t(scale)]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_SUBGRAPH as u32,
            Value::Descs(&[&sub]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_SUBGRAPH_INPUT_UID as u32,
            Value::I64(&[in_uid]),
        )?
        .set(
            A::CUDNN_ATTR_OPERATION_SDPA_FWD_SUBGRAPH_OUTPUT_UID as u32,
            Value::I64(&[out_uid]),
        )?;
        self.keep.extend(mask_ops);
        self.keep.push(sub);
        self.op(op, "SDPA forward")
    }

    /// cudnn-frontend's composite backward (its `CompositeSDPABackwardNode`
    /// with the deterministic algorithm): Δ = rowsum(dO ∘ O) into the
    /// workspace; P recomputed from the scores and the statistics; dV =
    /// Pᵀ·dO; dS = P ∘ (dO·Vᵀ − Δ) · scale; dK = dSᵀ·Q; dQ = dS·K.
    fn composite_backward(&mut self, band: bool) -> CudaResult<()> {
        use sys::cudnnReduceTensorOp_t as R;
        let (qkv, qkv_t, out, sc, sc_t, rows) = (
            self.qkv_layout(),
            self.qkv_transposed(),
            self.out_layout(),
            self.scores(),
            self.scores_transposed(),
            self.rows(),
        );
        let (b, h, t, d) = self.dims();
        let bf = Dt::CUDNN_DATA_BFLOAT16;
        let f = Dt::CUDNN_DATA_FLOAT;
        let q = self.real(UID_Q, bf, qkv)?;
        let kt = self.real(UID_K, bf, qkv_t)?;
        let vt = self.real(UID_V, bf, qkv_t)?;
        let o = self.real(UID_O, bf, out)?;
        let d_o = self.real(UID_DO, bf, out)?;
        let stats = self.real(UID_STATS, f, rows)?;
        let dq = self.real(UID_DQ, bf, qkv)?;
        let dk = self.real(UID_DK, bf, qkv)?;
        let dv = self.real(UID_DV, bf, qkv)?;
        let scale = self.scalar(UID_SCALE, 1.0 / (self.s.hs as f32).sqrt())?;
        let one = self.scalar(UID_ONE, 1.0)?;
        let neg = self.neg()?;
        // Δ = rowsum(dO ∘ O), kept in the workspace (the frontend's
        // `softmax_sum`; its layout must be packed).
        let t1 = self.virt(f, ([b, h, t, d], [h * t * d, t * d, h * d, 1]))?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, d_o, o, t1)?;
        let t2 = self.virt(f, rows)?;
        self.reduce(R::CUDNN_REDUCE_TENSOR_ADD, t1, t2)?;
        let bytes = (b * h * t * 4) as usize;
        let delta = self.scratch(UID_SOFTMAX_SUM, f, rows, bytes)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, t2, one, delta)?;
        // P = exp(scale · Q·Kᵀ − statistics), masked.
        let sc_ = self.virt(f, sc)?;
        self.matmul(q, kt, sc_)?;
        let s1 = self.virt(f, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, sc_, scale, s1)?;
        let s2 = self.virt(f, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_SUB, s1, stats, s2)?;
        let s3 = self.causal(s2, neg, band)?;
        let p = self.virt(f, sc)?;
        self.unary(Pw::CUDNN_POINTWISE_EXP, s3, p)?;
        // dV = Pᵀ·dO.
        let pt = self.virt(bf, sc_t)?;
        self.reshape(p, pt)?;
        self.matmul(pt, d_o, dv)?;
        // dS = P ∘ (dO·Vᵀ − Δ) · scale.
        let dp = self.virt(f, sc)?;
        self.matmul(d_o, vt, dp)?;
        let u = self.virt(f, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_SUB, dp, delta, u)?;
        let w = self.virt(f, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, u, p, w)?;
        let ds = self.virt(f, sc)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, w, scale, ds)?;
        // dK = dSᵀ·Q.
        let dst = self.virt(bf, sc_t)?;
        self.reshape(ds, dst)?;
        self.matmul(dst, q, dk)?;
        // dQ = dS·K: K is Kᵀ's tensor reshaped back.
        let k = self.virt(f, qkv)?;
        self.reshape(kt, k)?;
        self.matmul(ds, k, dq)
    }

    /// The operation graph of everything added, finalized with `handle`.
    fn finish(self, handle: RawHandle) -> CudaResult<Built> {
        let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        let refs: Vec<&Desc> = self.ops.iter().collect();
        // No handle (the tests' graphs, built with no device): unset, as
        // the frontend leaves it.
        if !handle.is_null() {
            graph.set(
                A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE as u32,
                Value::Handle(handle),
            )?;
        }
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS as u32, Value::Descs(&refs))?;
        let graph = graph.finalize("the operation graph")?;
        let mut keep = self.keep;
        keep.extend(self.ops);
        Ok(Built {
            graph,
            keep,
            scalars: self.scalars,
            scratch: self.scratch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every graph of every kind the loaded cuDNN offers, for both
    /// directions, is accepted (every descriptor and the operation graph
    /// finalize) without a device or a handle: the attribute types, the
    /// tensors' shapes and the operations' arity are what cuDNN checks
    /// there. Whether an engine takes a graph needs a GPU
    /// (`tests/cudnn.rs`). Skipped without libcudnn unless
    /// `BRAID_REQUIRE_CUDNN=1`.
    #[test]
    fn every_graph_finalizes_without_a_device() {
        if !super::super::cudnn_library_present() {
            assert!(
                std::env::var_os("BRAID_REQUIRE_CUDNN").is_none(),
                "BRAID_REQUIRE_CUDNN is set but libcudnn could not be loaded"
            );
            eprintln!("SKIPPED every_graph_finalizes_without_a_device: no libcudnn");
            return;
        }
        let version = super::super::backend::version().expect("cuDNN loaded");
        let shape = SdpaShape {
            b: 2,
            t: 128,
            nh: 3,
            hs: 64,
        };
        let mut built = 0;
        for direction in [Direction::Forward, Direction::Backward] {
            for kind in [GraphKind::Unified, GraphKind::Band, GraphKind::Composite] {
                let r = build(std::ptr::null_mut(), shape, direction, kind, version);
                if !kind.available(version, direction) {
                    assert!(
                        r.is_err(),
                        "{kind:?} {direction:?} is not offered by {version}"
                    );
                    continue;
                }
                let g = r.unwrap_or_else(|e| panic!("{kind:?} {direction:?} on {version}: {e}"));
                built += 1;
                let scalars: Vec<i64> = g.scalars.iter().map(|s| s.0).collect();
                assert!(
                    scalars.contains(&UID_SCALE),
                    "{kind:?} {direction:?} binds the scale"
                );
                if direction == Direction::Backward {
                    assert_eq!(
                        g.scratch,
                        vec![(UID_SOFTMAX_SUM, 2 * 3 * 128 * 4)],
                        "the backward keeps rowsum(dO ∘ O) in its workspace"
                    );
                }
            }
        }
        eprintln!("cuDNN {version}: {built} graphs finalized");
        assert!(built >= 2, "at least the composite graphs finalize");
    }
}
