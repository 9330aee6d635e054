//! What a task body runs with: its declared accesses and its context (the
//! stream, the rank, the device). Below the scheduler, which builds a
//! [`TaskCtx`] for every body it runs, and above the backends and buffers.

use crate::backend::DeviceCtx;
use crate::buffer::{AsView, View};
use crate::error::{Error, Result, TaskError};
use crate::graph::Mode;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::fmt;

/// One declared access, resolved to its buffer.
#[derive(Clone)]
pub(crate) struct Access {
    pub view: View,
    pub mode: Mode,
}

pub(crate) type Body = Box<dyn FnOnce(&TaskCtx<'_>) -> Result<(), TaskError> + Send + 'static>;

fn check_elems<T>(v: &View) -> Result<()> {
    let sz = size_of::<T>();
    if sz == 0 || v.len() % sz != 0 {
        return Err(Error::Misaligned {
            buffer: v.buf.name().to_string(),
            range: v.range(),
            ty: std::any::type_name::<T>(),
        });
    }
    Ok(())
}

type Borrow = (u64, usize, usize, bool);

pub(crate) use crate::backend::Check;

/// What a task body sees: its declared data, and the stream it runs on.
///
/// Data is reachable only here, only for the accesses the task declared and
/// only in the declared mode: `read` gives shared slices of any declared
/// access; `write` gives an exclusive slice of a declared `write` or
/// `read_write` access. Asking for the same bytes twice while one of the
/// borrows is exclusive is an error ([`Error::BorrowConflict`]), so safe code
/// can never hold aliasing slices.
pub struct TaskCtx<'a> {
    pub(crate) name: &'a str,
    pub(crate) accesses: &'a [Access],
    pub(crate) stream: usize,
    pub(crate) rank: usize,
    pub(crate) device: DeviceCtx<'a>,
    /// Host borrows handed out so far: (buffer id, start, end, exclusive).
    borrows: RefCell<SmallVec<[Borrow; 4]>>,
    checks: RefCell<Vec<Check>>,
}

impl fmt::Debug for TaskCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskCtx")
            .field("name", &self.name)
            .field("stream", &self.stream)
            .finish()
    }
}

impl<'a> TaskCtx<'a> {
    pub(crate) fn new(
        name: &'a str,
        accesses: &'a [Access],
        stream: usize,
        rank: usize,
        device: DeviceCtx<'a>,
    ) -> Self {
        TaskCtx {
            name,
            accesses,
            stream,
            rank,
            device,
            borrows: RefCell::new(SmallVec::new()),
            checks: RefCell::new(Vec::new()),
        }
    }

    /// Registers `check` to run when this task's work has completed: on the
    /// CPU right after the body returns, on CUDA once the task's end event has
    /// completed on the device. An error from it fails the task, as if the
    /// body had returned it — the way asynchronous device-side failures (an
    /// aborted collective, say) reach the task that caused them.
    pub fn on_complete(&self, check: impl FnOnce() -> Result<()> + Send + 'static) {
        self.checks.borrow_mut().push(Box::new(check));
    }

    pub(crate) fn take_checks(&self) -> Vec<Check> {
        let mut checks = std::mem::take(&mut *self.checks.borrow_mut());
        if let DeviceCtx::Cuda(c) = &self.device {
            checks.append(&mut c.take_checks());
        }
        checks
    }

    /// The task's name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Index of the stream the task runs on.
    pub fn stream_index(&self) -> usize {
        self.stream
    }

    /// The rank of the runtime (0 unless set by the builder or a launcher).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device-specific context (the raw CUDA stream on GPUs).
    pub fn device(&self) -> &DeviceCtx<'a> {
        &self.device
    }

    /// Shared host slice of a declared access (any mode) covering `v`.
    pub fn read<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<&[T]> {
        let v = v.as_view();
        let (ptr, len) = self.borrow_host::<T>(&v, false, true)?;
        // SAFETY: `borrow_host` checked that `v` lies inside a declared access of
        // this task, that the bytes are a whole aligned `[T]`, and recorded the
        // borrow so no exclusive borrow of overlapping bytes exists or can be
        // taken while this context lives; the dependency tracker guarantees no
        // other task writes these bytes while this one runs, and the buffer's
        // storage outlives the task (the launch holds it).
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) })
    }

    /// Exclusive host slice of a declared `write` or `read_write` access covering `v`.
    #[allow(clippy::mut_from_ref)]
    pub fn write<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<&mut [T]> {
        let v = v.as_view();
        let (ptr, len) = self.borrow_host::<T>(&v, true, true)?;
        // SAFETY: as in `read`, and the recorded exclusive borrow makes any other
        // borrow of overlapping bytes through this context fail, so this is the
        // only reference to them.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }

    /// Raw device address of a declared access covering `v` on a GPU buffer,
    /// for launching kernels. `write` asks for a writable access.
    pub fn device_ptr(&self, v: impl AsView, write: bool) -> Result<u64> {
        let v = v.as_view();
        self.check_declared(&v, write)?;
        v.buf
            .inner
            .storage
            .device_ptr(v.start)
            .ok_or_else(|| Error::WrongDevice {
                buffer: v.buf.name().to_string(),
                actual: v.buf.inner.storage.device_name(),
                wanted: "a GPU",
            })
    }

    /// Copies the bytes of a declared access covering `v` into a new vector,
    /// on any backend (on CUDA: a copy on the task's stream, waited for).
    pub fn read_to_vec<T: bytemuck::Pod>(&self, v: impl AsView) -> Result<Vec<T>> {
        let v = v.as_view();
        match &self.device {
            DeviceCtx::Cuda(c) => {
                self.check_declared(&v, false)?;
                check_elems::<T>(&v)?;
                let ptr = self.device_ptr(&v, false)?;
                let mut bytes = vec![0u8; v.len()];
                crate::backend::gpu::download(c.stream(), ptr, &mut bytes)?;
                Ok(bytemuck::pod_collect_to_vec(&bytes))
            }
            _ => {
                // A copy: no borrow outlives this call, so none is recorded.
                let (ptr, len) = self.borrow_host::<T>(&v, false, false)?;
                // SAFETY: as in `read`; the slice lives only for this copy.
                Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), len) }.to_vec())
            }
        }
    }

    /// Overwrites a declared writable access covering `v` with `data`, on any
    /// backend (on CUDA: a copy on the task's stream, waited for).
    pub fn write_from_slice<T: bytemuck::Pod>(&self, v: impl AsView, data: &[T]) -> Result<()> {
        let v = v.as_view();
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() != v.len() {
            return Err(Error::Misaligned {
                buffer: v.buf.name().to_string(),
                range: v.range(),
                ty: std::any::type_name::<T>(),
            });
        }
        match &self.device {
            DeviceCtx::Cuda(c) => {
                let ptr = self.device_ptr(&v, true)?;
                crate::backend::gpu::upload(c.stream(), ptr, bytes)
            }
            _ => {
                let (ptr, len) = self.borrow_host::<u8>(&v, true, false)?;
                // SAFETY: as in `write`; the slice lives only for this copy.
                unsafe { std::slice::from_raw_parts_mut(ptr, len) }.copy_from_slice(bytes);
                Ok(())
            }
        }
    }

    fn check_declared(&self, v: &View, write: bool) -> Result<()> {
        let ok = self.accesses.iter().any(|a| {
            a.view.buf.id() == v.buf.id()
                && a.view.start <= v.start
                && v.end <= a.view.end
                && (!write || a.mode.writes())
        });
        if ok {
            Ok(())
        } else {
            Err(Error::Undeclared {
                task: self.name.to_string(),
                buffer: v.buf.name().to_string(),
                range: v.range(),
                mode: if write { "write" } else { "read" },
            })
        }
    }

    /// Checks a host access to `v` and, with `keep`, records it as a borrow
    /// that lasts as long as the context.
    fn borrow_host<T>(&self, v: &View, write: bool, keep: bool) -> Result<(*mut u8, usize)> {
        self.check_declared(v, write)?;
        let sz = size_of::<T>();
        let base = v
            .buf
            .inner
            .storage
            .host_ptr()
            .ok_or_else(|| Error::WrongDevice {
                buffer: v.buf.name().to_string(),
                actual: v.buf.inner.storage.device_name(),
                wanted: "the host",
            })?;
        // SAFETY: `v.start <= v.end <= len` holds for every view (checked when
        // the view was made), so the offset stays inside the allocation.
        let ptr = unsafe { base.add(v.start) };
        if sz == 0 || v.len() % sz != 0 || (ptr as usize) % align_of::<T>() != 0 {
            return Err(Error::Misaligned {
                buffer: v.buf.name().to_string(),
                range: v.range(),
                ty: std::any::type_name::<T>(),
            });
        }
        let mut b = self.borrows.borrow_mut();
        let id = v.buf.id();
        if b.iter()
            .any(|&(bid, s, e, w)| bid == id && s < v.end && v.start < e && (w || write))
        {
            return Err(Error::BorrowConflict {
                task: self.name.to_string(),
                buffer: v.buf.name().to_string(),
                range: v.range(),
            });
        }
        if keep {
            b.push((id, v.start, v.end, write));
        }
        Ok((ptr, v.len() / sz))
    }
}
