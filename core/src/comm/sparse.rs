//! Gradients with several writers: row contributions exchanged on their own.
//!
//! A parameter's gradient may be written by several tasks, each complete at
//! its own point of the backward pass. The tied embedding of a language model
//! is the case that matters: the classifier writes all of `dwte` at the very
//! start of the backward pass, the encoder adds the rows of the tokens seen at
//! its very end. Reduced as one gradient, `dwte` (most of a small model's
//! parameters) can start its all-reduce only after the last task.
//!
//! So the reducer takes each writer on its own: the dense part is marked
//! complete with [`Reducer::grad_ready`](super::Reducer::grad_ready) and
//! all-reduced (averaged) with its bucket at once; a contribution that touches
//! only some rows is handed over when it is complete
//! ([`Reducer::sparse_ready`](super::Reducer::sparse_ready)) as [`SparseRows`]
//! — row ids and rows of the gradient's storage type (`f32` or bf16),
//! written *instead of* added into the gradient. The reducer then links each
//! id to its next repeat ([`sparse_links`], one task) and exchanges ids,
//! links and rows with three all-gathers, submitted right then — so each
//! rank must hand a contribution over at the same point of its
//! `grad_ready` calls (once the same parameters are marked, e.g. after all
//! of them): bucket all-reduces go out as their parameters are marked, and
//! a rank whose all-gathers fall between other buckets than another rank's
//! issues its collectives in another order. At
//! [`Reducer::finish`](super::Reducer::finish), after every bucket, one task
//! per contribution adds every rank's rows, divided by the number of ranks,
//! into the averaged gradient ([`sparse_add_chunk`], rank by rank).
//!
//! What is computed, exactly (the same bits on every rank and backend): for
//! each rank's contribution in rank order, each row id it names is loaded
//! once as `f32`, gets `scale · row` (rounded, then added and rounded:
//! never fused) for each of its rows in order, and is stored once (rounded to
//! bf16 with bf16 gradients). With `f32` gradients this is, bit for bit, the
//! rows added one by one. The result is the average of the full gradients,
//! as if each rank had added its rows before an all-reduce; only the rounding
//! differs. The add runs after the bucket's all-reduce by inference (both
//! write the gradient), never because of a host wait.
//!
//! While sync is off ([`Reducer::no_sync`](super::Reducer::no_sync)), a
//! contribution is added locally at once (no exchange, no scaling), so the
//! gradients accumulate as they would with one writer.
//!
//! Both tasks have a CPU body and a CUDA body (`cuda/kernels/sparse_rows.cu`:
//! no atomics, one writer per gradient element). The CPU body fails, changing
//! nothing, on an id past the gradient's rows; the CUDA kernel skips such a
//! row (it never writes outside the gradient) but cannot report it without a
//! host wait, so on a GPU the ids are the program's contract.

use super::{out_of_place, Bf16, BoundComm, CollectiveKind, DType, Element};
use crate::buffer::{Buffer, View};
use crate::cuda::{
    engine_kernels, CompileOptions, CudaFunction, KernelArgs, KernelCache, LaunchConfig,
};
use crate::error::{Error, Result};
use crate::kind::TaskKind;
use crate::{CudaTaskCtx, DevSlice, DevSliceMut, TaskError};
use std::collections::HashMap;
use std::sync::Arc;

/// A contribution to some rows of a parameter's gradient: row `ids[i]` (a
/// `u32`; rows of `row_len` elements, counted from the parameter's start)
/// receives `rows[i]` (`row_len` elements of the gradient's storage type:
/// `f32`, or [`Bf16`] for bf16 gradients). `ids` holds `n` ids, `rows`
/// `n × row_len` values.
#[derive(Debug, Clone)]
pub struct SparseRows {
    /// Row ids (`u32`), one per row of `rows`; repeats add up.
    pub ids: View,
    /// The rows, `row_len` values each, of the gradient's storage type.
    pub rows: View,
    /// Elements per row.
    pub row_len: usize,
}

impl SparseRows {
    /// Rows `rows` for the row ids `ids`, `row_len` elements each.
    pub fn new(ids: View, rows: View, row_len: usize) -> Self {
        SparseRows { ids, rows, row_len }
    }

    /// The number of rows, after checking the views' sizes against a
    /// gradient of `grad_elems` elements of `dtype`.
    fn count(&self, grad_elems: usize, dtype: DType) -> std::result::Result<usize, String> {
        if self.row_len == 0 || grad_elems % self.row_len != 0 {
            return Err(format!(
                "rows of {} elements do not tile its {grad_elems} gradients",
                self.row_len
            ));
        }
        if self.ids.len() % 4 != 0 {
            return Err(format!(
                "the row ids `{}` are {} bytes, not a whole number of u32s",
                self.ids.buf.name(),
                self.ids.len()
            ));
        }
        let n = self.ids.len() / 4;
        let want = n * self.row_len * dtype.size();
        if self.rows.len() != want {
            return Err(format!(
                "{n} row ids need {want} bytes of {} rows, `{}` has {}",
                dtype.name(),
                self.rows.buf.name(),
                self.rows.len()
            ));
        }
        Ok(n)
    }
}

/// The storage types a row contribution may have: `f32` and [`Bf16`],
/// loaded exactly as `f32` and stored rounded to nearest, ties to even.
pub trait RowElement: Element {
    /// The exact `f32` value.
    fn load(self) -> f32;
    /// `x` rounded to this type.
    fn store(x: f32) -> Self;
}

impl RowElement for f32 {
    fn load(self) -> f32 {
        self
    }
    fn store(x: f32) -> Self {
        x
    }
}

impl RowElement for Bf16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(x: f32) -> Self {
        Bf16::from_f32(x)
    }
}

/// Bit 31 of a link: an earlier index holds the same id.
const REPEAT: u32 = 1 << 31;

/// The chains [`sparse_add_chunk`] walks: `links[i]` is the next index
/// `r > i` with `ids[r] == ids[i]` (`ids.len()` if none), with bit 31 set
/// when an earlier index holds the same id. The CPU reference of the
/// `sparse_rows_links` kernel.
pub fn sparse_links(ids: &[u32], links: &mut [u32]) {
    assert_eq!(ids.len(), links.len(), "sparse_links: one link per id");
    let n = ids.len() as u32;
    let mut next: HashMap<u32, u32> = HashMap::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate().rev() {
        links[i] = next.insert(id, i as u32).unwrap_or(n);
    }
    // `next` now maps each id to its first index.
    for (i, &id) in ids.iter().enumerate() {
        if next[&id] != i as u32 {
            links[i] |= REPEAT;
        }
    }
}

/// Adds one rank's contribution: `grad[ids[i]] += scale · rows[i]` for the
/// `n` rows (`row_len` elements each), each touched gradient element loaded
/// once, its contributions added in `f32` in row order (`scale · row`
/// rounded, then the sum: never fused), stored once; `links` as
/// [`sparse_links`] made them. Fails, changing nothing, if an id is past
/// `grad`'s rows. The CPU reference of the `sparse_rows_add_*` kernels.
pub fn sparse_add_chunk<E: RowElement>(
    grad: &mut [E],
    ids: &[u32],
    links: &[u32],
    rows: &[E],
    row_len: usize,
    scale: f32,
) -> std::result::Result<(), String> {
    let n = ids.len();
    assert!(
        links.len() == n && rows.len() == n * row_len && row_len > 0,
        "sparse_add_chunk: {n} ids need {n} links and {} row elements",
        n * row_len
    );
    let nrows = grad.len() / row_len;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= nrows) {
        return Err(format!("row id {bad} is past the gradient's {nrows} rows"));
    }
    let mut acc = vec![0f32; row_len];
    for head in (0..n).filter(|&i| links[i] & REPEAT == 0) {
        let g = &mut grad[ids[head] as usize * row_len..][..row_len];
        for (a, &x) in acc.iter_mut().zip(g.iter()) {
            *a = x.load();
        }
        let mut r = head;
        while r < n {
            for (a, &x) in acc.iter_mut().zip(&rows[r * row_len..][..row_len]) {
                *a += scale * x.load();
            }
            r = (links[r] & !REPEAT) as usize;
        }
        for (x, &a) in g.iter_mut().zip(&acc) {
            *x = E::store(a);
        }
    }
    Ok(())
}

/// The reducer's side of the exchange: links and gather buffers, reused from
/// step to step, the CUDA kernels, and this step's contributions, added at
/// `finish`.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    /// Each contribution's links (`n` u32), by row count.
    links: Vec<(usize, Buffer)>,
    /// Gather buffers by (rows per rank, row length, storage type): ids,
    /// links, rows.
    gathered: Vec<((usize, usize, DType), [Buffer; 3])>,
    /// The kernels, loaded at the first contribution on a CUDA runtime.
    kernels: Option<Arc<Kernels>>,
    pending: Vec<Pending>,
}

/// `cuda/kernels/sparse_rows.cu`'s functions on the runtime's device.
#[derive(Debug)]
struct Kernels {
    links: CudaFunction,
    add_f32: CudaFunction,
    add_bf16: CudaFunction,
}

/// One contribution to add: `chunks` ranks' rows of `n` rows each.
#[derive(Debug)]
struct Pending {
    name: String,
    grad: View,
    ids: View,
    links: View,
    rows: View,
    n: usize,
    row_len: usize,
    dtype: DType,
    scale: f32,
}

impl Exchange {
    /// Takes contribution `c` to the gradient view `grad` (of `dtype`
    /// elements) of parameter `name`: links and exchanges it now (or, with
    /// `sync` off, adds it locally now). A contribution that does not fit is
    /// refused with `refuse(reason)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take(
        &mut self,
        comm: &BoundComm<'_>,
        name: &str,
        grad: View,
        dtype: DType,
        c: SparseRows,
        sync: bool,
        refuse: impl Fn(String) -> Error,
    ) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::Bf16) {
            return Err(refuse(format!(
                "row contributions are f32 or bf16, the gradients are {}",
                dtype.name()
            )));
        }
        let n = c.count(grad.len() / dtype.size(), dtype).map_err(&refuse)?;
        let kernels = self.kernels(comm)?;
        let links = self.links_buffer(comm, n)?.whole();
        submit_links(comm, name, &c.ids, &links, n, kernels.clone())?;
        let mut p = Pending {
            name: name.to_string(),
            grad,
            ids: c.ids,
            links,
            rows: c.rows,
            n,
            row_len: c.row_len,
            dtype,
            scale: 1.0,
        };
        if !sync {
            return add_rows(comm, &p, kernels);
        }
        let [gids, glinks, grows] = self.gathered(comm, n, c.row_len, dtype)?.map(|b| b.whole());
        // Named `all_gather rows…`: each rank adds its own rows, so what
        // is gathered grows with the ranks (the step simulator prices these
        // gathers by that rule, benches/src/simulate).
        let gather = |what: &str, send: &View, recv: &View, dt: DType| {
            comm.submit_named(
                format!("all_gather rows: {what} of {name}"),
                CollectiveKind::AllGather,
                dt,
                out_of_place(send, recv),
            )
        };
        gather("ids", &p.ids, &gids, DType::I32)?;
        gather("links", &p.links, &glinks, DType::I32)?;
        gather("rows", &p.rows, &grows, dtype)?;
        (p.ids, p.links, p.rows) = (gids, glinks, grows);
        p.scale = 1.0 / comm.world_size() as f32;
        self.pending.push(p);
        Ok(())
    }

    /// Adds this step's exchanged contributions (call after every bucket).
    pub(super) fn finish(&mut self, comm: &BoundComm<'_>) -> Result<()> {
        for p in std::mem::take(&mut self.pending) {
            add_rows(comm, &p, self.kernels.clone())?;
        }
        Ok(())
    }

    /// The kernels on a CUDA runtime (loaded once), `None` on the CPU.
    fn kernels(&mut self, comm: &BoundComm<'_>) -> Result<Option<Arc<Kernels>>> {
        let Some(dev) = comm.runtime().cuda_device() else {
            return Ok(None);
        };
        if self.kernels.is_none() {
            let m = KernelCache::global().module_with_headers(
                dev,
                engine_kernels::SPARSE_ROWS,
                engine_kernels::HEADERS,
                "sparse_rows.cu",
                &CompileOptions::for_device(dev),
            )?;
            self.kernels = Some(Arc::new(Kernels {
                links: m.function("sparse_rows_links")?,
                add_f32: m.function("sparse_rows_add_f32")?,
                add_bf16: m.function("sparse_rows_add_bf16")?,
            }));
        }
        Ok(self.kernels.clone())
    }

    fn links_buffer(&mut self, comm: &BoundComm<'_>, n: usize) -> Result<Buffer> {
        if let Some((_, b)) = self.links.iter().find(|(k, _)| *k == n) {
            return Ok(b.clone());
        }
        let b = comm.runtime().alloc(format!("row links ({n})"), n * 4)?;
        self.links.push((n, b.clone()));
        Ok(b)
    }

    fn gathered(
        &mut self,
        comm: &BoundComm<'_>,
        n: usize,
        row_len: usize,
        dtype: DType,
    ) -> Result<[Buffer; 3]> {
        let key = (n, row_len, dtype);
        if let Some((_, b)) = self.gathered.iter().find(|(k, _)| *k == key) {
            return Ok(b.clone());
        }
        let (rt, world) = (comm.runtime(), comm.world_size());
        let b = [
            rt.alloc(format!("gathered row ids ({n} x {world})"), n * world * 4)?,
            rt.alloc(format!("gathered row links ({n} x {world})"), n * world * 4)?,
            rt.alloc(
                format!("gathered rows ({n} x {row_len} x {world})"),
                n * row_len * world * dtype.size(),
            )?,
        ];
        self.gathered.push((key, b.clone()));
        Ok(b)
    }
}

/// Submits `links = sparse_links(ids)` on the comm stream.
fn submit_links(
    comm: &BoundComm<'_>,
    name: &str,
    ids: &View,
    links: &View,
    n: usize,
    kernels: Option<Arc<Kernels>>,
) -> Result<()> {
    comm.runtime()
        .task(format!("link sparse rows of {name}"))
        .kind(TaskKind::Comm)
        .comm_stream(comm.comm_stream())
        .run_any(
            (ids.read::<u32>(), links.write::<u32>()),
            |(ids, links)| sparse_links(ids, links),
            move |(ids, links), cu| -> std::result::Result<(), TaskError> {
                let k = kernels
                    .as_ref()
                    .ok_or("the sparse-row kernels are not loaded")?;
                if n == 0 {
                    return Ok(());
                }
                let mut a = KernelArgs::new();
                a.ptr(links.ptr()).ptr(ids.ptr()).i32(dim(n)?);
                // SAFETY: sparse_rows_links(uint* links, const uint* ids, int
                // n): both views hold n u32s (the task's accesses).
                unsafe {
                    k.links
                        .launch(cu.stream(), LaunchConfig::linear(n, 256), &a)
                }?;
                Ok(())
            },
        )
        .map(|_| ())
}

/// Submits the add of `p` (its `rows.len() / (n · row_len)` ranks' rows, in
/// rank order) on the comm stream.
fn add_rows(comm: &BoundComm<'_>, p: &Pending, kernels: Option<Arc<Kernels>>) -> Result<()> {
    match p.dtype {
        DType::Bf16 => add_rows_as::<Bf16>(comm, p, kernels),
        _ => add_rows_as::<f32>(comm, p, kernels),
    }
}

fn add_rows_as<E: RowElement>(
    comm: &BoundComm<'_>,
    p: &Pending,
    kernels: Option<Arc<Kernels>>,
) -> Result<()> {
    let (name, n, row_len, scale) = (p.name.clone(), p.n, p.row_len, p.scale);
    let chunks = p.ids.len() / 4 / n.max(1);
    comm.runtime()
        .task(format!("add sparse rows of {name}"))
        .kind(TaskKind::Comm)
        .comm_stream(comm.comm_stream())
        .run_any(
            (
                p.grad.read_write::<E>(),
                p.ids.read::<u32>(),
                p.links.read::<u32>(),
                p.rows.read::<E>(),
            ),
            move |(g, ids, links, rows)| -> std::result::Result<(), TaskError> {
                let nrows = g.len() / row_len;
                // Checked first, so a bad id changes nothing.
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= nrows) {
                    return Err(format!(
                        "row id {bad} is past the {nrows} rows of `{name}`'s gradient"
                    )
                    .into());
                }
                for r in 0..chunks {
                    let (i, ri) = (r * n..(r + 1) * n, r * n * row_len..(r + 1) * n * row_len);
                    sparse_add_chunk(g, &ids[i.clone()], &links[i], &rows[ri], row_len, scale)?;
                }
                Ok(())
            },
            move |(g, ids, links, rows), cu| {
                add_rows_cuda(&kernels, cu, g, ids, links, rows, n, row_len, scale)
            },
        )
        .map(|_| ())
}

/// The CUDA body of the add: one `sparse_rows_add_*` launch per rank, in
/// rank order on the task's stream.
#[allow(clippy::too_many_arguments)]
fn add_rows_cuda<E: RowElement>(
    kernels: &Option<Arc<Kernels>>,
    cu: &CudaTaskCtx<'_>,
    g: DevSliceMut<'_, E>,
    ids: DevSlice<'_, u32>,
    links: DevSlice<'_, u32>,
    rows: DevSlice<'_, E>,
    n: usize,
    row_len: usize,
    scale: f32,
) -> std::result::Result<(), TaskError> {
    let k = kernels
        .as_ref()
        .ok_or("the sparse-row kernels are not loaded")?;
    let f = match E::DTYPE {
        DType::Bf16 => &k.add_bf16,
        _ => &k.add_f32,
    };
    if n == 0 {
        return Ok(());
    }
    let nrows = (g.len() / row_len) as i64;
    let es = std::mem::size_of::<E>() as u64;
    for r in 0..ids.len() / n {
        let (at, row_at) = ((r * n * 4) as u64, (r * n * row_len) as u64 * es);
        let mut a = KernelArgs::new();
        a.ptr(g.ptr())
            .ptr(ids.ptr() + at)
            .ptr(links.ptr() + at)
            .ptr(rows.ptr() + row_at)
            .i32(dim(n)?)
            .i32(dim(row_len)?)
            .i64(nrows)
            .f32(scale);
        // SAFETY: sparse_rows_add_{f32,bf16}(E* grad, const uint* ids, const
        // uint* links, const E* rows, int n, int row_len, long long nrows,
        // float scale), E the views' element type: rank r's n ids and links
        // and n·row_len row elements lie inside the views (r < len / n), and
        // the kernel writes only rows below nrows of `grad`.
        unsafe {
            f.launch(
                cu.stream(),
                LaunchConfig::grid_block(dim(n)? as u32, 128),
                &a,
            )
        }?;
    }
    Ok(())
}

/// `x` as a kernel's `int`.
fn dim(x: usize) -> std::result::Result<i32, TaskError> {
    i32::try_from(x).map_err(|_| format!("{x} rows is too many for one launch").into())
}
