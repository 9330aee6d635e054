//! Typed access tokens: a task names each access once.
//!
//! `x.read::<f32>()`, `y.write::<f32>()` and `z.read_write::<f32>()` (on a
//! [`Buffer`] or a [`View`]) make small tokens that carry the view and the
//! element type. A task is submitted with a set of tokens — one token, a tuple
//! of up to twelve, an `Option`, a `Vec` or an array of them — and
//! [`TaskBuilder::run`](crate::TaskBuilder::run) declares exactly those
//! accesses to the dependency tracker and hands the body exactly that data:
//!
//! | token | CPU body gets | CUDA body gets |
//! |---|---|---|
//! | [`Read<T>`] | `&[T]` | [`DevSlice<T>`] |
//! | [`Write<T>`], [`ReadWrite<T>`] | `&mut [T]` | [`DevSliceMut<T>`] |
//! | [`DynAccess`] (mode known at run time) | [`HostBytes`] | [`DevBytes`] |
//! | `(A, B, …)`, `Option<A>`, `Vec<A>`, `[A; N]` | the same shape | the same shape |
//!
//! A body therefore cannot reach a buffer it did not declare, nor write
//! through a read token: the compiler says so, not the run time.
//!
//! ```compile_fail,E0594
//! # use braid::Runtime;
//! # let rt = Runtime::cpu()?;
//! # let x = rt.alloc("x", 16)?;
//! // A read token gives `&[f32]`: writing through it does not compile.
//! rt.task("bad").run(x.read::<f32>(), |x| x[0] = 1.0)?;
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! Device addresses live only as long as the body: a CUDA body cannot keep
//! one for a later task, after its buffer may have been freed.
//!
//! ```compile_fail
//! # use braid::{DevSlice, Runtime};
//! # let rt = Runtime::cpu()?;
//! # let x = rt.alloc("x", 16)?;
//! let (keep, _kept) = std::sync::mpsc::channel::<DevSlice<'static, f32>>();
//! rt.task("leak").run_cuda(x.read::<f32>(), move |x, _cu| keep.send(x).unwrap())?;
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! ```
//! # use braid::{DevSlice, Runtime};
//! # let rt = Runtime::cpu()?;
//! # let x = rt.alloc("x", 16)?;
//! // Using the address inside the body is fine (on this CPU runtime the task
//! // is refused at submission: it has no CPU body).
//! let r = rt.task("use").run_cuda(x.read::<f32>(), |x, _cu| assert_eq!(x.len(), 4));
//! assert!(matches!(r, Err(braid::Error::NoBody { .. })));
//! # Ok::<(), braid::Error>(())
//! ```
//!
//! # What is checked when
//!
//! At submission, before the task enters the graph: every token's view fits a
//! whole number of `T`s at an aligned offset ([`Error::Misaligned`]), and no
//! two tokens of one task overlap where either writes
//! ([`Error::BorrowConflict`]) — so the `&mut [T]` a body gets never aliases
//! another slice it gets. While the body runs, the dependency tracker
//! guarantees no other task touches bytes this task writes, nor writes bytes
//! it reads (semantics 2 and 3).

use crate::buffer::{Buffer, View};
use crate::error::{Error, Result};
use crate::graph::Mode;
use std::fmt;
use std::marker::PhantomData;

mod sealed {
    pub trait Sealed {}
}

/// A set of typed accesses: a token, or a tuple, `Option`, `Vec` or array of
/// tokens. Implemented by Braid only (the set is what makes the body's data
/// safe to hand out).
pub trait Accesses: sealed::Sealed + Send + 'static {
    /// What a CPU body gets: `&[T]` for reads, `&mut [T]` for writes, in the
    /// shape of the set.
    type Host<'a>;
    /// What a CUDA body gets: typed device addresses, in the shape of the set,
    /// valid only while the body runs (they cannot leave it).
    type Device<'a>;

    /// The set's addresses, resolved at submission: plain data the body
    /// carries instead of the views (so a task holds one reference to each
    /// buffer, in its declared accesses, and none is dropped on a stream
    /// thread).
    #[doc(hidden)]
    type Raw: Send + 'static;

    /// The addresses of the accesses in the runtime `to` names: host
    /// pointers, or device addresses on a GPU. The one place a view meets a
    /// runtime: a buffer of another runtime is refused here.
    #[doc(hidden)]
    fn resolve(&self, to: Target) -> Result<Self::Raw>;

    /// Consumes the set, calling `f` once per access with its view, mode,
    /// element size and alignment.
    #[doc(hidden)]
    fn declare(self, f: &mut dyn FnMut(View, Mode, Elem));

    /// The host slices at `raw`.
    ///
    /// # Safety
    /// `raw` was resolved for the host from a set that passed the submission
    /// checks, and while the returned slices live no other code reads bytes
    /// a write token covers nor writes bytes any token covers (the engine's
    /// dependency tracking gives this) and the buffers stay alive (the task's
    /// declared accesses hold them).
    #[doc(hidden)]
    unsafe fn host(raw: &Self::Raw) -> Self::Host<'_>;

    /// The device slices at `raw`.
    #[doc(hidden)]
    fn device(raw: &Self::Raw) -> Self::Device<'_>;
}

/// Where a set is resolved: the runtime and whether its memory is a GPU's.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub(crate) runtime: u64,
    pub(crate) device: bool,
}

/// A resolved access: its first byte's address and its length (elements).
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct RawSlice {
    addr: u64,
    len: usize,
}

/// The element type of a token, as the submission checks see it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct Elem {
    size: usize,
    align: usize,
    name: &'static str,
}

impl Elem {
    fn of<T>() -> Elem {
        Elem {
            size: size_of::<T>(),
            align: align_of::<T>(),
            name: std::any::type_name::<T>(),
        }
    }
}

/// Host pointer to the first byte of `v`, or an error if it lives on a device.
fn host_ptr(v: &View) -> Result<*mut u8> {
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
    // SAFETY: `v.start <= v.end <= len` holds for every view (checked when the
    // view was made), so the offset stays inside the allocation.
    Ok(unsafe { base.add(v.start) })
}

/// The address of `v`'s first byte in `to` (on the device or the host),
/// after checking that `v` belongs to `to`'s runtime.
fn resolve(v: &View, to: Target) -> Result<u64> {
    crate::buffer::check_runtime(v, to.runtime)?;
    if to.device {
        device_ptr(v)
    } else {
        host_ptr(v).map(|p| p as usize as u64)
    }
}

/// Device address of the first byte of `v`, or an error if it lives on the host.
fn device_ptr(v: &View) -> Result<u64> {
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

macro_rules! token {
    ($(#[$doc:meta])* $name:ident, $mode:expr, $host:ty, $dev:ident, $from_raw:ident) => {
        $(#[$doc])*
        pub struct $name<T> {
            view: View,
            _t: PhantomData<fn() -> T>,
        }

        impl<T> $name<T> {
            /// The view this token accesses.
            pub fn view(&self) -> &View {
                &self.view
            }
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                $name { view: self.view.clone(), _t: PhantomData }
            }
        }

        impl<T> fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}<{}>({:?})", stringify!($name), std::any::type_name::<T>(), self.view)
            }
        }

        impl<T> sealed::Sealed for $name<T> {}

        impl<T: bytemuck::Pod + Send + Sync> Accesses for $name<T> {
            type Host<'a> = $host;
            type Device<'a> = $dev<'a, T>;

            type Raw = RawSlice;

            fn resolve(&self, to: Target) -> Result<RawSlice> {
                Ok(RawSlice {
                    addr: resolve(&self.view, to)?,
                    len: self.view.len() / size_of::<T>().max(1),
                })
            }

            fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
                f(self.view, $mode, Elem::of::<T>());
            }

            unsafe fn host(raw: &RawSlice) -> Self::Host<'_> {
                // SAFETY: the submission check made the view a whole, aligned
                // `[T]` at this host address; the caller guarantees
                // exclusivity and liveness as this function's contract
                // states; `T: Pod` makes any bytes a valid `T`.
                unsafe { std::slice::$from_raw(raw.addr as usize as *mut T, raw.len) }
            }

            fn device(raw: &RawSlice) -> Self::Device<'_> {
                $dev {
                    ptr: raw.addr,
                    len: raw.len,
                    _t: PhantomData,
                }
            }
        }
    };
}

token!(
    /// Reads a view as `[T]`: made by [`View::read`] or [`Buffer::read`].
    Read, Mode::Read, &'a [T], DevSlice, from_raw_parts
);
token!(
    /// Overwrites a view as `[T]` without reading it first: made by
    /// [`View::write`] or [`Buffer::write`].
    Write, Mode::Write, &'a mut [T], DevSliceMut, from_raw_parts_mut
);
token!(
    /// Reads and updates a view as `[T]`: made by [`View::read_write`] or
    /// [`Buffer::read_write`].
    ReadWrite, Mode::ReadWrite, &'a mut [T], DevSliceMut, from_raw_parts_mut
);

macro_rules! dev_slice {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub struct $name<'a, T> {
            ptr: u64,
            len: usize,
            _t: PhantomData<(fn() -> T, &'a ())>,
        }

        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<'_, T> {}

        impl<T> fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}<{}>({:#x}, {})", stringify!($name), std::any::type_name::<T>(), self.ptr, self.len)
            }
        }

        impl<T> $name<'_, T> {
            /// The device address of the first element.
            pub fn ptr(&self) -> u64 {
                self.ptr
            }

            /// Number of elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the slice is empty.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// Length in bytes.
            pub fn bytes(&self) -> usize {
                self.len * size_of::<T>()
            }
        }
    };
}

dev_slice!(
    /// A declared read on a CUDA device: `len` elements of `T` at `ptr`.
    DevSlice
);
dev_slice!(
    /// A declared write (or read-write) on a CUDA device: `len` elements of
    /// `T` at `ptr`.
    DevSliceMut
);

impl<'a, T> DevSliceMut<'a, T> {
    /// The same memory as a read-only slice.
    pub fn as_read(&self) -> DevSlice<'a, T> {
        DevSlice {
            ptr: self.ptr,
            len: self.len,
            _t: PhantomData,
        }
    }
}

/// An access whose mode is known only at run time, on raw bytes (the form the
/// collectives and the C++ API use).
#[derive(Clone, Debug)]
pub struct DynAccess {
    view: View,
    mode: Mode,
}

impl DynAccess {
    /// An access to `v` in `mode`.
    pub fn new(v: View, mode: Mode) -> DynAccess {
        DynAccess { view: v, mode }
    }

    /// The view.
    pub fn view(&self) -> &View {
        &self.view
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

/// The host bytes of a [`DynAccess`]: shared for a read, exclusive otherwise.
#[derive(Debug)]
pub enum HostBytes<'a> {
    /// A declared read.
    Read(&'a [u8]),
    /// A declared write or read-write.
    Write(&'a mut [u8]),
}

impl HostBytes<'_> {
    /// The bytes, readable in either mode.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            HostBytes::Read(b) => b,
            HostBytes::Write(b) => b,
        }
    }

    /// The bytes, if the access writes.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match self {
            HostBytes::Read(_) => None,
            HostBytes::Write(b) => Some(b),
        }
    }
}

/// The device bytes of a [`DynAccess`], valid while the task body runs.
#[derive(Debug, Clone, Copy)]
pub struct DevBytes<'a> {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Whether the access writes.
    pub writes: bool,
    _body: PhantomData<&'a ()>,
}

impl sealed::Sealed for DynAccess {}

impl Accesses for DynAccess {
    type Host<'a> = HostBytes<'a>;
    type Device<'a> = DevBytes<'a>;
    type Raw = (RawSlice, bool);

    fn resolve(&self, to: Target) -> Result<(RawSlice, bool)> {
        let raw = RawSlice {
            addr: resolve(&self.view, to)?,
            len: self.view.len(),
        };
        Ok((raw, self.mode.writes()))
    }

    fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
        f(self.view, self.mode, Elem::of::<u8>());
    }

    unsafe fn host(&(raw, writes): &(RawSlice, bool)) -> HostBytes<'_> {
        let p = raw.addr as usize as *mut u8;
        // SAFETY: as for the typed tokens; bytes need no alignment.
        unsafe {
            if writes {
                HostBytes::Write(std::slice::from_raw_parts_mut(p, raw.len))
            } else {
                HostBytes::Read(std::slice::from_raw_parts(p, raw.len))
            }
        }
    }

    fn device(&(raw, writes): &(RawSlice, bool)) -> DevBytes<'_> {
        DevBytes {
            ptr: raw.addr,
            len: raw.len,
            writes,
            _body: PhantomData,
        }
    }
}

impl sealed::Sealed for () {}

impl Accesses for () {
    type Host<'a> = ();
    type Device<'a> = ();
    type Raw = ();

    fn resolve(&self, _: Target) -> Result<()> {
        Ok(())
    }

    fn declare(self, _: &mut dyn FnMut(View, Mode, Elem)) {}

    unsafe fn host(_: &()) {}

    fn device(_: &()) {}
}

impl<A: Accesses> sealed::Sealed for Option<A> {}

impl<A: Accesses> Accesses for Option<A> {
    type Host<'a> = Option<A::Host<'a>>;
    type Device<'a> = Option<A::Device<'a>>;
    type Raw = Option<A::Raw>;

    fn resolve(&self, to: Target) -> Result<Self::Raw> {
        self.as_ref().map(|a| a.resolve(to)).transpose()
    }

    fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
        if let Some(a) = self {
            a.declare(f);
        }
    }

    unsafe fn host(raw: &Self::Raw) -> Self::Host<'_> {
        // SAFETY: the caller's guarantee covers every token of the set.
        raw.as_ref().map(|r| unsafe { A::host(r) })
    }

    fn device(raw: &Self::Raw) -> Self::Device<'_> {
        raw.as_ref().map(A::device)
    }
}

impl<A: Accesses> sealed::Sealed for Vec<A> {}

impl<A: Accesses> Accesses for Vec<A> {
    type Host<'a> = Vec<A::Host<'a>>;
    type Device<'a> = Vec<A::Device<'a>>;
    type Raw = Vec<A::Raw>;

    fn resolve(&self, to: Target) -> Result<Self::Raw> {
        self.iter().map(|a| a.resolve(to)).collect()
    }

    fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
        for a in self {
            a.declare(f);
        }
    }

    unsafe fn host(raw: &Self::Raw) -> Self::Host<'_> {
        // SAFETY: the caller's guarantee covers every token of the set.
        raw.iter().map(|r| unsafe { A::host(r) }).collect()
    }

    fn device(raw: &Self::Raw) -> Self::Device<'_> {
        raw.iter().map(A::device).collect()
    }
}

impl<A: Accesses, const N: usize> sealed::Sealed for [A; N] {}

impl<A: Accesses, const N: usize> Accesses for [A; N] {
    type Host<'a> = [A::Host<'a>; N];
    type Device<'a> = [A::Device<'a>; N];
    type Raw = Vec<A::Raw>;

    fn resolve(&self, to: Target) -> Result<Self::Raw> {
        self.iter().map(|a| a.resolve(to)).collect()
    }

    fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
        for a in self {
            a.declare(f);
        }
    }

    unsafe fn host(raw: &Self::Raw) -> Self::Host<'_> {
        // SAFETY: the caller's guarantee covers every token of the set.
        std::array::from_fn(|i| unsafe { A::host(&raw[i]) })
    }

    fn device(raw: &Self::Raw) -> Self::Device<'_> {
        std::array::from_fn(|i| A::device(&raw[i]))
    }
}

macro_rules! tuple {
    ($($a:ident $i:tt),+) => {
        impl<$($a: Accesses),+> sealed::Sealed for ($($a,)+) {}

        impl<$($a: Accesses),+> Accesses for ($($a,)+) {
            type Host<'a> = ($($a::Host<'a>,)+);
            type Device<'a> = ($($a::Device<'a>,)+);
            type Raw = ($($a::Raw,)+);

            fn resolve(&self, to: Target) -> Result<Self::Raw> {
                Ok(($(self.$i.resolve(to)?,)+))
            }

            fn declare(self, f: &mut dyn FnMut(View, Mode, Elem)) {
                $(self.$i.declare(f);)+
            }

            unsafe fn host(raw: &Self::Raw) -> Self::Host<'_> {
                // SAFETY: the caller's guarantee covers every token of the set.
                ($(unsafe { $a::host(&raw.$i) },)+)
            }

            fn device(raw: &Self::Raw) -> Self::Device<'_> {
                ($($a::device(&raw.$i),)+)
            }
        }
    };
}

tuple!(A 0);
tuple!(A 0, B 1);
tuple!(A 0, B 1, C 2);
tuple!(A 0, B 1, C 2, D 3);
tuple!(A 0, B 1, C 2, D 3, E 4);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11);

/// Declares the accesses of `set` for task `task` into `out` and checks
/// them: each view a whole, aligned `[T]`; no two overlapping where either
/// writes.
pub(crate) fn collect<A: Accesses>(
    task: &str,
    set: A,
    out: &mut smallvec::SmallVec<[crate::ctx::Access; 4]>,
) -> Result<()> {
    let mut err = None;
    set.declare(&mut |view: View, mode, e: Elem| {
        if err.is_some() {
            return;
        }
        // The check below is of the offset in the buffer: it is the
        // address's alignment only up to the buffers' own.
        if e.align > crate::backend::cpu::ALIGN {
            err = Some(Error::Usage(format!(
                "task `{task}`: `{}` needs {}-byte alignment, and buffers are aligned to {} bytes",
                e.name,
                e.align,
                crate::backend::cpu::ALIGN
            )));
            return;
        }
        if e.size == 0 || view.len() % e.size != 0 || view.start % e.align != 0 {
            err = Some(Error::Misaligned {
                task: Some(task.to_string()),
                buffer: view.buf.name().to_string(),
                range: view.range(),
                ty: e.name,
            });
            return;
        }
        out.push(crate::ctx::Access { view, mode });
    });
    if let Some(e) = err {
        return Err(e);
    }
    check_disjoint(task, out)
}

/// No two accesses of one task overlap where either writes: the slices its
/// body gets never alias a `&mut`.
fn check_disjoint(task: &str, acc: &[crate::ctx::Access]) -> Result<()> {
    let conflict = |a: &crate::ctx::Access, b: &crate::ctx::Access| {
        a.view.buf.id() == b.view.buf.id()
            && a.view.start < b.view.end
            && b.view.start < a.view.end
            && (a.mode.writes() || b.mode.writes())
    };
    let error = |a: &crate::ctx::Access| Error::BorrowConflict {
        task: task.to_string(),
        buffer: a.view.buf.name().to_string(),
        range: a.view.range(),
    };
    if acc.len() <= 16 {
        for (i, a) in acc.iter().enumerate() {
            if acc[i + 1..].iter().any(|b| conflict(a, b)) {
                return Err(error(a));
            }
        }
        return Ok(());
    }
    // Many accesses (a bucket's views): sort by position, then each access
    // only needs checking against those that start before it ends.
    let mut idx: Vec<usize> = (0..acc.len()).collect();
    idx.sort_by_key(|&i| (acc[i].view.buf.id(), acc[i].view.start));
    for (k, &i) in idx.iter().enumerate() {
        for &j in &idx[k + 1..] {
            let (a, b) = (&acc[i], &acc[j]);
            if b.view.buf.id() != a.view.buf.id() || b.view.start >= a.view.end {
                break;
            }
            if conflict(a, b) {
                return Err(error(a));
            }
        }
    }
    Ok(())
}

impl View {
    /// A token that reads this view as `[T]`.
    pub fn read<T>(&self) -> Read<T> {
        Read {
            view: self.clone(),
            _t: PhantomData,
        }
    }

    /// A token that overwrites this view as `[T]` (its old contents are not read).
    pub fn write<T>(&self) -> Write<T> {
        Write {
            view: self.clone(),
            _t: PhantomData,
        }
    }

    /// A token that reads and updates this view as `[T]`.
    pub fn read_write<T>(&self) -> ReadWrite<T> {
        ReadWrite {
            view: self.clone(),
            _t: PhantomData,
        }
    }

    /// A byte access in a mode chosen at run time.
    pub fn access(&self, mode: Mode) -> DynAccess {
        DynAccess::new(self.clone(), mode)
    }
}

impl Buffer {
    /// A token that reads the whole buffer as `[T]`.
    pub fn read<T>(&self) -> Read<T> {
        self.whole().read()
    }

    /// A token that overwrites the whole buffer as `[T]`.
    pub fn write<T>(&self) -> Write<T> {
        self.whole().write()
    }

    /// A token that reads and updates the whole buffer as `[T]`.
    pub fn read_write<T>(&self) -> ReadWrite<T> {
        self.whole().read_write()
    }

    /// A byte access to the whole buffer in a mode chosen at run time.
    pub fn access(&self, mode: Mode) -> DynAccess {
        self.whole().access(mode)
    }
}
