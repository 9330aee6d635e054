//! Buffers and views: byte ranges the engine tracks.

use crate::backend::Storage;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};
use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

pub(crate) struct BufferInner {
    pub(crate) id: u64,
    pub(crate) runtime: u64,
    pub(crate) name: Cow<'static, str>,
    pub(crate) len: usize,
    pub(crate) storage: Storage,
    /// Told when the buffer is dropped, so the tracker can forget it.
    pub(crate) on_drop: Arc<Dropped>,
}

impl Drop for BufferInner {
    fn drop(&mut self) {
        self.on_drop.push(self.id);
    }
}

/// Ids of dropped buffers, for the tracker to forget at the next submission.
/// `any` lets submission skip the lock when nothing was dropped.
#[derive(Debug, Default)]
pub(crate) struct Dropped {
    ids: Mutex<Vec<u64>>,
    any: AtomicBool,
}

impl Dropped {
    pub(crate) fn push(&self, id: u64) {
        lock(&self.ids).push(id);
        self.any.store(true, Ordering::Release);
    }
    pub(crate) fn drain(&self) -> Vec<u64> {
        if !self.any.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *lock(&self.ids))
    }
}

/// A block of memory owned by a [`Runtime`](crate::Runtime).
///
/// Cheap to clone (a reference count). Its contents are reachable only inside
/// tasks that declare an access to it (or to a [`View`] of it), and through the
/// runtime's read-back and upload helpers, which are themselves tasks. The
/// memory is released once the last handle is gone and every task that touched
/// it has completed.
#[derive(Clone)]
pub struct Buffer {
    pub(crate) inner: Arc<BufferInner>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("name", &self.inner.name)
            .field("len", &self.inner.len)
            .field("device", &self.inner.storage.device_name())
            .finish()
    }
}

impl Buffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer holds zero bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The name given at allocation (used in errors and traces).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Number of whole `T` elements the buffer holds.
    pub fn len_of<T>(&self) -> usize {
        self.inner.len / size_of::<T>().max(1)
    }

    /// A view of the bytes `range`.
    pub fn view(&self, range: Range<usize>) -> Result<View> {
        if range.start > range.end || range.end > self.inner.len {
            return Err(Error::ViewOutOfBounds {
                buffer: self.inner.name.to_string(),
                start: range.start,
                end: range.end,
                len: self.inner.len,
            });
        }
        Ok(View {
            buf: self.clone(),
            start: range.start,
            end: range.end,
        })
    }

    /// A view of the elements `range`, counted in `T`s.
    pub fn view_of<T>(&self, range: Range<usize>) -> Result<View> {
        self.view(element_bytes::<T>(self.name(), range)?)
    }

    /// The view of the whole buffer.
    pub fn whole(&self) -> View {
        View {
            buf: self.clone(),
            start: 0,
            end: self.inner.len,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }
}

/// A byte range of a [`Buffer`]. Tasks declare accesses on views; two
/// accesses conflict when their ranges overlap and at least one writes.
#[derive(Clone)]
pub struct View {
    pub(crate) buf: Buffer,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "View({} {}..{})", self.buf.name(), self.start, self.end)
    }
}

impl View {
    /// The buffer this view belongs to.
    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }

    /// Byte range within the buffer.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// A sub-view, with `range` relative to this view's start.
    pub fn view(&self, range: Range<usize>) -> Result<View> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::ViewOutOfBounds {
                buffer: self.buf.name().to_string(),
                start: self.start.saturating_add(range.start),
                end: self.start.saturating_add(range.end),
                len: self.buf.len(),
            });
        }
        Ok(View {
            buf: self.buf.clone(),
            start: self.start + range.start,
            end: self.start + range.end,
        })
    }

    /// A sub-view of the elements `range` (counted in `T`s from this view's start).
    pub fn view_of<T>(&self, range: Range<usize>) -> Result<View> {
        self.view(element_bytes::<T>(self.buf.name(), range)?)
    }
}

/// The bytes of the `T`s `range`, or an error naming the elements asked
/// for when their bytes are past any address (rather than a made-up range).
fn element_bytes<T>(buffer: &str, range: Range<usize>) -> Result<Range<usize>> {
    let sz = size_of::<T>();
    match (range.start.checked_mul(sz), range.end.checked_mul(sz)) {
        (Some(s), Some(e)) => Ok(s..e),
        _ => Err(Error::Usage(format!(
            "elements {range:?} of `{}` in buffer `{buffer}`: their bytes are past any address",
            std::any::type_name::<T>()
        ))),
    }
}

/// Anything that names a byte range: a [`Buffer`] (all of it) or a [`View`].
pub trait AsView {
    /// The view this value names.
    fn as_view(&self) -> View;
}

impl AsView for Buffer {
    fn as_view(&self) -> View {
        self.whole()
    }
}

impl AsView for View {
    fn as_view(&self) -> View {
        self.clone()
    }
}

impl<T: AsView + ?Sized> AsView for &T {
    fn as_view(&self) -> View {
        (**self).as_view()
    }
}

/// Refuses a view of a buffer that another runtime owns.
pub(crate) fn check_runtime(view: &View, runtime: u64) -> Result<()> {
    let owner = view.buf.inner.runtime;
    if owner != runtime {
        return Err(Error::ForeignBuffer {
            task: None,
            buffer: view.buf.name().to_string(),
            owner,
            runtime,
        });
    }
    Ok(())
}
