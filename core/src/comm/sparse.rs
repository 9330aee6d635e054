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
//! — row ids and rows, written *instead of* added into the gradient — and
//! exchanged with two all-gathers (ids, rows) submitted right then. At
//! [`Reducer::finish`](super::Reducer::finish), after every bucket, one task
//! per contribution adds every rank's rows, divided by the number of ranks,
//! into the averaged gradient: rank by rank, row by row, so every rank
//! computes the same bits. The result is the average of the full gradients,
//! as if each rank had added its rows before an all-reduce; only the rounding
//! differs. The add runs after the bucket's all-reduce by inference (both
//! write the gradient), never because of a host wait.
//!
//! While sync is off ([`Reducer::no_sync`](super::Reducer::no_sync)), a
//! contribution is added locally at once (no exchange, no scaling), so the
//! gradients accumulate as they would with one writer.
//!
//! The adds have a CPU body only: on a CUDA runtime `sparse_ready` refuses
//! contributions with a clear error (a deterministic scatter-add kernel is
//! still to write).

use super::BoundComm;
use crate::buffer::{Buffer, View};
use crate::error::{Error, Result};
use crate::kind::TaskKind;

/// A contribution to some rows of a parameter's gradient: row `ids[i]` (a
/// `u32`; rows of `row_len` elements, counted from the parameter's start)
/// receives `rows[i]` (`row_len` `f32`s). `ids` holds `n` ids, `rows`
/// `n × row_len` values.
#[derive(Debug, Clone)]
pub struct SparseRows {
    /// Row ids (`u32`), one per row of `rows`; repeats add up.
    pub ids: View,
    /// The rows (`f32`), `row_len` values each.
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
    /// gradient of `grad_elems` elements.
    fn count(&self, grad_elems: usize) -> std::result::Result<usize, String> {
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
        if self.rows.len() != n * self.row_len * 4 {
            return Err(format!(
                "{n} row ids need {} bytes of rows, `{}` has {}",
                n * self.row_len * 4,
                self.rows.buf.name(),
                self.rows.len()
            ));
        }
        Ok(n)
    }
}

/// The reducer's side of the exchange: gather buffers, reused from step to
/// step, and this step's contributions, added at `finish`.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    /// Gather buffers by (rows per rank, row length): ids, rows.
    gathered: Vec<((usize, usize), Buffer, Buffer)>,
    pending: Vec<Pending>,
}

#[derive(Debug)]
struct Pending {
    name: String,
    grad: View,
    ids: View,
    rows: View,
    row_len: usize,
    scale: f32,
}

impl Exchange {
    /// Takes contribution `c` to the gradient view `grad` of parameter
    /// `name`: exchanges it now (or, with `sync` off, adds it locally now).
    /// A contribution that does not fit is refused with `refuse(reason)`.
    pub(super) fn take(
        &mut self,
        comm: &BoundComm<'_>,
        name: &str,
        grad: View,
        c: SparseRows,
        sync: bool,
        refuse: impl Fn(String) -> Error,
    ) -> Result<()> {
        let n = c.count(grad.len() / 4).map_err(&refuse)?;
        let backend = comm.runtime().backend_name();
        if backend != "cpu" {
            return Err(refuse(format!(
                "sparse contributions need the CPU backend for now (this runtime is {backend})"
            )));
        }
        if !sync {
            return add_rows(comm, name, &grad, &c.ids, &c.rows, c.row_len, 1.0);
        }
        let (gids, grows) = self.buffers(comm, n, c.row_len)?;
        let (gids, grows) = (gids.whole(), grows.whole());
        comm.all_gather_into::<i32>(&c.ids, &gids)?;
        comm.all_gather_into::<f32>(&c.rows, &grows)?;
        self.pending.push(Pending {
            name: name.to_string(),
            grad,
            ids: gids,
            rows: grows,
            row_len: c.row_len,
            scale: 1.0 / comm.world_size() as f32,
        });
        Ok(())
    }

    /// Adds this step's exchanged contributions (call after every bucket).
    pub(super) fn finish(&mut self, comm: &BoundComm<'_>) -> Result<()> {
        for p in std::mem::take(&mut self.pending) {
            add_rows(comm, &p.name, &p.grad, &p.ids, &p.rows, p.row_len, p.scale)?;
        }
        Ok(())
    }

    fn buffers(
        &mut self,
        comm: &BoundComm<'_>,
        n: usize,
        row_len: usize,
    ) -> Result<(Buffer, Buffer)> {
        if let Some((_, i, r)) = self.gathered.iter().find(|(k, _, _)| *k == (n, row_len)) {
            return Ok((i.clone(), r.clone()));
        }
        let (rt, world) = (comm.runtime(), comm.world_size());
        let ids = rt.alloc(format!("gathered row ids ({n} x {world})"), n * world * 4)?;
        let rows = rt.alloc(
            format!("gathered rows ({n} x {row_len} x {world})"),
            n * row_len * world * 4,
        )?;
        self.gathered
            .push(((n, row_len), ids.clone(), rows.clone()));
        Ok((ids, rows))
    }
}

/// Submits `grad[ids[i]] += scale · rows[i]`, in order, on the comm stream;
/// fails (changing nothing) if an id is past the gradient's rows.
fn add_rows(
    comm: &BoundComm<'_>,
    name: &str,
    grad: &View,
    ids: &View,
    rows: &View,
    row_len: usize,
    scale: f32,
) -> Result<()> {
    let what = name.to_string();
    comm.runtime()
        .task(format!("add sparse rows of {name}"))
        .kind(TaskKind::Comm)
        .comm_stream(comm.comm_stream())
        .run(
            (
                grad.read_write::<f32>(),
                ids.read::<u32>(),
                rows.read::<f32>(),
            ),
            move |(g, ids, rows)| -> std::result::Result<(), crate::TaskError> {
                let nrows = g.len() / row_len;
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= nrows) {
                    return Err(format!(
                        "row id {bad} is past the {nrows} rows of `{what}`'s gradient"
                    )
                    .into());
                }
                for (&id, row) in ids.iter().zip(rows.chunks_exact(row_len)) {
                    let dst = &mut g[id as usize * row_len..][..row_len];
                    for (d, &r) in dst.iter_mut().zip(row) {
                        *d += scale * r;
                    }
                }
                Ok(())
            },
        )
        .map(|_| ())
}
