//! The one way into the emulator: [`launch`] runs a kernel that a
//! `csrc/kernels_*.cpp` file exports (`BRAID_EMU_EXPORT`), by name, with a
//! list of [`Arg`]s: buffers (copied into [`Guarded`] buffers, checked and
//! copied back) and scalars. The wrappers build that list with [`Args`],
//! which checks each buffer's length as it adds it.

use std::ffi::{c_int, c_void, CStr, CString};

use bytemuck::Pod;

use crate::check::{need, need_at_least};
use crate::Dim3;

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    extern "C" {
        pub fn emu_last_error() -> *const c_char;
        pub fn emu_launch(
            kernel: *const c_char,
            param_types: *const c_char,
            nargs: c_int,
            args: *const *const c_void,
            gx: u32,
            gy: u32,
            gz: u32,
            bx: u32,
            by: u32,
            bz: u32,
            reverse: c_int,
        ) -> c_int;
    }
}

/// An element type of a kernel's buffers, with its C++ spelling (as
/// `ParamType` in `csrc/cuda_emu.h` spells it).
pub(crate) trait Elem: Pod {
    const C_TYPE: &'static str;
}

impl Elem for f32 {
    const C_TYPE: &'static str = "float";
}
impl Elem for f64 {
    const C_TYPE: &'static str = "double";
}
impl Elem for i32 {
    const C_TYPE: &'static str = "int";
}
impl Elem for u32 {
    const C_TYPE: &'static str = "unsigned";
}
/// bf16 bit patterns: `bf16_t` is `unsigned short` (bf16.cuh).
impl Elem for u16 {
    const C_TYPE: &'static str = "unsigned short";
}

/// Canary bytes on each side of every buffer a kernel gets.
const GUARD_BYTES: usize = 64 * 1024;
const CANARY: u8 = 0xff;

/// A kernel's copy of one argument slice, between two canary regions.
pub(crate) struct Guarded<'a> {
    name: &'static str,
    c_type: &'static str, // of an element
    words: Vec<u64>,      // u64, so the guard before the data is whole words
    /// Where the data starts in `words`: past the guard, at the caller's
    /// address modulo 16, so a kernel that checks its pointers' 16-byte
    /// alignment (the bf16 vector paths) takes the path it would take on
    /// the caller's slice, not one an aligned copy would give it.
    g: usize,
    len: usize,  // bytes of data
    elem: usize, // bytes of an element
    back: Option<&'a mut [u8]>,
}

impl<'a> Guarded<'a> {
    fn new<T: Elem>(name: &'static str, data: &[T]) -> Self {
        let data: &[u8] = bytemuck::cast_slice(data);
        let mut words = vec![u64::MAX; (2 * GUARD_BYTES + 16 + data.len()).div_ceil(8)];
        let base = words.as_ptr() as usize;
        let g = GUARD_BYTES + (((data.as_ptr() as usize & 15) + 16 - (base & 15)) & 15);
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[g..][..data.len()].copy_from_slice(data);
        Guarded {
            g,
            name,
            c_type: T::C_TYPE,
            words,
            len: data.len(),
            elem: size_of::<T>(),
            back: None,
        }
    }

    /// The data's address, for the kernel. The pointer carries the whole
    /// allocation's provenance, so a kernel that strays into the canaries
    /// stays within memory it may touch.
    fn ptr(&mut self) -> *mut c_void {
        self.words
            .as_mut_ptr()
            .cast::<u8>()
            .wrapping_add(self.g)
            .cast()
    }

    /// The first out-of-bounds write the canaries show, if any.
    fn check(&self, kernel: &str) -> Result<(), String> {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        let (before, rest) = bytes.split_at(self.g);
        let after = &rest[self.len..][..GUARD_BYTES];
        let (n, name) = (self.len / self.elem, self.name);
        if let Some(i) = before.iter().rposition(|&b| b != CANARY) {
            let e = (self.g - i).div_ceil(self.elem);
            return Err(format!(
                "{kernel}: wrote {name}[-{e}], before the start of its {n} elements"
            ));
        }
        if let Some(i) = after.iter().position(|&b| b != CANARY) {
            let e = n + i / self.elem;
            return Err(format!(
                "{kernel}: wrote {name}[{e}], past the end of its {n} elements"
            ));
        }
        Ok(())
    }

    /// Whether the buffer (canaries included) holds `other`'s bits: else the
    /// first element that differs, as a race between the two runs' orders.
    fn same_as(&self, kernel: &str, other: &[u64]) -> Result<(), String> {
        let (a, b): (&[u8], &[u8]) = (
            bytemuck::cast_slice(&self.words),
            bytemuck::cast_slice(other),
        );
        match a.iter().zip(b).position(|(x, y)| x != y) {
            None => Ok(()),
            Some(i) => {
                let e = (i as isize - self.g as isize).div_euclid(self.elem as isize);
                Err(format!(
                    "{kernel}: {}[{e}] differs between a run with the blocks and threads in \
                     order and one in the opposite order: a race (a missing __syncthreads, or \
                     threads or blocks writing what others read or write)",
                    self.name
                ))
            }
        }
    }

    /// Copies an output back to the caller's slice.
    fn copy_back(self) {
        if let Some(dst) = self.back {
            dst.copy_from_slice(&bytemuck::cast_slice(&self.words)[self.g..][..self.len]);
        }
    }
}

/// One kernel argument, in the kernel's parameter order. Each knows the C++
/// type it stands for ([`Arg::c_type`]), which `emu_launch` compares with the
/// kernel's own parameter list before it reads any argument.
pub(crate) enum Arg<'a> {
    /// A buffer: `const T*` for one the kernel reads ([`Arg::input`]), `T*`
    /// for one it writes ([`Arg::output`], copied back after a clean launch).
    Buf(Guarded<'a>),
    /// A null `const T*` (`write` false) or `T*`: an optional buffer left out.
    Null { c_type: &'static str, write: bool },
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

impl<'a> Arg<'a> {
    /// A buffer the kernel reads (`const T*`): a copy of `s`.
    pub(crate) fn input<T: Elem>(name: &'static str, s: &[T]) -> Self {
        Arg::Buf(Guarded::new(name, s))
    }

    /// A buffer the kernel writes, or reads and writes (`T*`): a copy of `s`,
    /// copied back only after a launch with no error and intact canaries.
    pub(crate) fn output<T: Elem>(name: &'static str, s: &'a mut [T]) -> Self {
        let mut g = Guarded::new(name, s);
        g.back = Some(bytemuck::cast_slice_mut(s));
        Arg::Buf(g)
    }

    /// [`Arg::input`], or a null `const T*` for `None`.
    pub(crate) fn input_or_null<T: Elem>(name: &'static str, s: Option<&[T]>) -> Self {
        s.map_or(
            Arg::Null {
                c_type: T::C_TYPE,
                write: false,
            },
            |s| Arg::input(name, s),
        )
    }

    /// [`Arg::output`], or a null `T*` for `None`.
    pub(crate) fn output_or_null<T: Elem>(name: &'static str, s: Option<&'a mut [T]>) -> Self {
        s.map_or(
            Arg::Null {
                c_type: T::C_TYPE,
                write: true,
            },
            |s| Arg::output(name, s),
        )
    }

    /// The C++ type this argument passes, spelled as `ParamType` spells it.
    fn c_type(&self) -> String {
        match self {
            Arg::Buf(g) => pointer(g.c_type, g.back.is_some()),
            Arg::Null { c_type, write } => pointer(c_type, *write),
            Arg::I32(_) => "int".into(),
            Arg::I64(_) => "long long".into(),
            Arg::F32(_) => "float".into(),
        }
    }
}

/// A kernel's argument list, in its parameter order, for [`launch`]: each
/// buffer's length is checked as it is added (the error [`need`] or
/// [`need_at_least`] returns, naming the kernel and the buffer), so a wrapper
/// builds the whole list before it launches, and a wrong length launches
/// nothing and leaves every output alone.
pub(crate) struct Args<'a> {
    kernel: &'a str,
    list: Vec<Arg<'a>>,
}

impl<'a> Args<'a> {
    /// An empty list for `kernel` (the name [`launch`] runs, and the prefix
    /// of every error).
    pub(crate) fn new(kernel: &'a str) -> Self {
        Args {
            kernel,
            list: Vec::new(),
        }
    }

    fn push(mut self, arg: Arg<'a>) -> Self {
        self.list.push(arg);
        self
    }

    /// [`Arg::input`] of exactly `len` elements.
    pub(crate) fn input<T: Elem>(
        self,
        name: &'static str,
        s: &'a [T],
        len: usize,
    ) -> Result<Self, String> {
        need(self.kernel, name, s.len(), len)?;
        Ok(self.push(Arg::input(name, s)))
    }

    /// [`Arg::output`] of exactly `len` elements.
    pub(crate) fn output<T: Elem>(
        self,
        name: &'static str,
        s: &'a mut [T],
        len: usize,
    ) -> Result<Self, String> {
        need(self.kernel, name, s.len(), len)?;
        Ok(self.push(Arg::output(name, s)))
    }

    /// [`Arg::input`] of at least `len` elements.
    pub(crate) fn input_at_least<T: Elem>(
        self,
        name: &'static str,
        s: &'a [T],
        len: usize,
    ) -> Result<Self, String> {
        need_at_least(self.kernel, name, s.len(), len)?;
        Ok(self.push(Arg::input(name, s)))
    }

    /// [`Arg::input_or_null`]: `None`, or exactly `len` elements.
    pub(crate) fn input_or_null<T: Elem>(
        self,
        name: &'static str,
        s: Option<&'a [T]>,
        len: usize,
    ) -> Result<Self, String> {
        if let Some(s) = s {
            need(self.kernel, name, s.len(), len)?;
        }
        Ok(self.push(Arg::input_or_null(name, s)))
    }

    /// [`Arg::output_or_null`]: `None`, or exactly `len` elements.
    pub(crate) fn output_or_null<T: Elem>(
        self,
        name: &'static str,
        s: Option<&'a mut [T]>,
        len: usize,
    ) -> Result<Self, String> {
        if let Some(s) = &s {
            need(self.kernel, name, s.len(), len)?;
        }
        Ok(self.push(Arg::output_or_null(name, s)))
    }

    /// [`Arg::input`] whose length the wrapper has checked itself, before
    /// (a shape no exact or minimum length expresses, such as whole rows).
    pub(crate) fn input_prechecked<T: Elem>(self, name: &'static str, s: &'a [T]) -> Self {
        self.push(Arg::input(name, s))
    }

    /// [`Arg::output`] whose length the wrapper has checked itself, before.
    pub(crate) fn output_prechecked<T: Elem>(self, name: &'static str, s: &'a mut [T]) -> Self {
        self.push(Arg::output(name, s))
    }

    /// An `int`.
    pub(crate) fn i32(self, x: i32) -> Self {
        self.push(Arg::I32(x))
    }

    /// `int`s, in order.
    pub(crate) fn i32s<const N: usize>(mut self, xs: [i32; N]) -> Self {
        self.list.extend(xs.map(Arg::I32));
        self
    }

    /// A `long long`.
    pub(crate) fn i64(self, x: i64) -> Self {
        self.push(Arg::I64(x))
    }

    /// A `float`.
    pub(crate) fn f32(self, x: f32) -> Self {
        self.push(Arg::F32(x))
    }

    /// `float`s, in order.
    pub(crate) fn f32s<const N: usize>(mut self, xs: [f32; N]) -> Self {
        self.list.extend(xs.map(Arg::F32));
        self
    }

    /// [`launch`]es the kernel with these arguments.
    ///
    /// # Safety
    ///
    /// As [`launch`]'s: every index the kernel can form from these
    /// arguments, on this grid and block, lies inside the buffer it indexes.
    pub(crate) unsafe fn launch(self, grid: Dim3, block: Dim3) -> Result<(), String> {
        // SAFETY: the caller's obligation is launch's (this function's
        // Safety section).
        unsafe { launch(self.kernel, grid, block, self.list) }
    }
}

/// `T*`, or `const T*` for a buffer the kernel does not write.
fn pointer(c_type: &str, write: bool) -> String {
    let c = if write { "" } else { "const " };
    format!("{c}{c_type}*")
}

/// The calling thread's last launch error.
fn last_error() -> String {
    // SAFETY: emu_last_error returns a NUL-terminated string owned by the
    // calling thread's emulator state, unchanged until this thread's next
    // launch; it is copied here at once.
    unsafe { CStr::from_ptr(ffi::emu_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Runs the exported kernel `kernel` (its name in the `.cu` file) on `grid`
/// and `block` with `args`, twice from the same buffers: its blocks and
/// threads in order, then in the opposite order. Returns the emulator's
/// error (a kernel not exported, arguments whose types are not its
/// parameters', a deadlock, `__trap()`, ...), else the first out-of-bounds
/// write the canaries show, else the first element the two runs disagree
/// on (a race: a missing `__syncthreads`, or blocks or threads writing what
/// others read or write, whose outcome CUDA leaves to the order they run
/// in), each prefixed with `kernel`; copies the outputs back only if there
/// is none of these.
///
/// # Safety
///
/// The argument types are checked (by `emu_launch`, against the kernel's
/// own parameter list); their meaning is the caller's: every index the
/// kernel can form from these arguments, on this grid and block, must lie
/// inside the buffer it indexes. The canaries turn a write slightly out of
/// bounds into an error, not one further out.
pub(crate) unsafe fn launch(
    kernel: &str,
    grid: Dim3,
    block: Dim3,
    mut args: Vec<Arg<'_>>,
) -> Result<(), String> {
    let name = CString::new(kernel).map_err(|_| format!("{kernel}: a NUL in the name"))?;
    let types = args.iter().map(Arg::c_type).collect::<Vec<_>>().join(", ");
    let types = CString::new(types).expect("C++ type names have no NUL");
    let nargs = c_int::try_from(args.len()).map_err(|_| format!("{kernel}: too many arguments"))?;
    // Each pointer argument's value, then each argument's address.
    let ptrs: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| match a {
            Arg::Buf(g) => g.ptr(),
            _ => std::ptr::null_mut(),
        })
        .collect();
    let addrs: Vec<*const c_void> = args
        .iter()
        .zip(&ptrs)
        .map(|(a, p)| match a {
            Arg::Buf(_) | Arg::Null { .. } => std::ptr::from_ref(p).cast(),
            Arg::I32(x) => std::ptr::from_ref(x).cast(),
            Arg::I64(x) => std::ptr::from_ref(x).cast(),
            Arg::F32(x) => std::ptr::from_ref(x).cast(),
        })
        .collect();
    let run = |reverse: bool| {
        // SAFETY: `name` and `types` are NUL-terminated and outlive the
        // call. `addrs` holds `nargs` addresses, the i-th at a live value of
        // the type the i-th name of `types` spells: an i32 (`int`), i64
        // (`long long`) or f32 (`float`) in `args`, or a pointer in `ptrs`
        // (`T*` and `const T*` are both pointers), null or a Guarded
        // buffer's data. emu_launch starts the kernel only if `nargs` is its
        // number of parameters and `types` their types (cuda_emu.h's
        // ParamType), so each argument it reads is a value of the type it
        // reads it as. `ptrs` is not touched and no buffer of `args` moves
        // (their contents are only reset in place between the two runs)
        // until the calls return. That the kernel's indices stay inside the
        // buffers is the caller's obligation (this function's Safety
        // section).
        let rc = unsafe {
            ffi::emu_launch(
                name.as_ptr(),
                types.as_ptr(),
                nargs,
                addrs.as_ptr(),
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                c_int::from(reverse),
            )
        };
        if rc != 0 {
            return Err(format!("{kernel}: {}", last_error()));
        }
        Ok(())
    };
    // Every buffer as it starts (canaries included), for the second run.
    let start: Vec<Vec<u64>> = bufs_of(&args).map(|g| g.words.clone()).collect();
    run(false)?;
    let forward: Vec<Vec<u64>> = bufs_of(&args).map(|g| g.words.clone()).collect();
    for (g, s) in bufs_mut(&mut args).zip(&start) {
        g.words.copy_from_slice(s);
    }
    run(true)?;
    for g in bufs_of(&args) {
        g.check(kernel)?;
    }
    for (g, f) in bufs_of(&args).zip(&forward) {
        g.same_as(kernel, f)?;
    }
    args.into_iter()
        .filter_map(|a| match a {
            Arg::Buf(g) => Some(g),
            _ => None,
        })
        .for_each(Guarded::copy_back);
    Ok(())
}

fn bufs_of<'s, 'a>(args: &'s [Arg<'a>]) -> impl Iterator<Item = &'s Guarded<'a>> {
    args.iter().filter_map(|a| match a {
        Arg::Buf(g) => Some(g),
        _ => None,
    })
}

fn bufs_mut<'s, 'a>(args: &'s mut [Arg<'a>]) -> impl Iterator<Item = &'s mut Guarded<'a>> {
    args.iter_mut().filter_map(|a| match a {
        Arg::Buf(g) => Some(g),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::{launch, Arg, Args};

    /// `Args` checks each buffer's length as it adds it, with `need`'s and
    /// `need_at_least`'s messages; a wrapper builds the whole list first, so
    /// a wrong length anywhere launches nothing and leaves the outputs alone.
    #[test]
    fn args_check_lengths_before_any_launch() {
        let k = "selftest_block_sum";
        let mut out = [7.0f32; 2];
        let err = Args::new(k).output("out", &mut out, 1).err();
        assert_eq!(
            err.as_deref(),
            Some("selftest_block_sum: out has 2 elements, expected 1")
        );
        let err = Args::new(k).input_at_least("inp", &[0.0f32; 3], 4).err();
        let want = "selftest_block_sum: inp has 3 elements, expected at least 4";
        assert_eq!(err.as_deref(), Some(want));
        let err = Args::new(k).input_or_null("s", Some(&[0.0f32; 2]), 1).err();
        assert_eq!(
            err.as_deref(),
            Some("selftest_block_sum: s has 2 elements, expected 1")
        );
        assert!(Args::new(k).input_or_null::<f32>("s", None, 1).is_ok());
        // The first buffer right, the last wrong: nothing runs.
        let (mut d, a) = ([7.0f32; 128], [0u16; 256]);
        let err = crate::selftest_mma((1, 1, 1), (32, 1, 1), &mut d, &a, &[0; 127]).unwrap_err();
        assert_eq!(err, "selftest_mma: b has 127 elements, expected 128");
        assert_eq!((out, d), ([7.0; 2], [7.0; 128]));
    }

    /// `emu_launch` refuses, before reading any argument, a name no file
    /// exports and arguments that are not the kernel's parameters (in number,
    /// type or constness); the outputs are left alone.
    #[test]
    fn arguments_must_be_the_kernels_parameters() {
        let (grid, block, inp) = ((1, 1, 1), (32, 1, 1), [1.0f32; 32]);
        let (mut outs, mut d) = ([[0.0f32; 1]; 2], [0.0f32; 128]);
        let [out1, out2] = &mut outs;
        let cases: [(&str, Vec<Arg<'_>>, &str); 5] = [
            (
                "no_such_kernel",
                vec![],
                "no_such_kernel: no kernel of this name",
            ),
            (
                "selftest_block_sum",
                vec![Arg::output("out", out1), Arg::input("inp", &inp)],
                "selftest_block_sum: called with 2 arguments (float*, const float*), \
                 but the kernel's parameters are (float*, const float*, int)",
            ),
            (
                "selftest_block_sum",
                vec![
                    Arg::output("out", out2),
                    Arg::input("inp", &inp),
                    Arg::I64(32),
                ],
                "(float*, const float*, long long), but",
            ),
            (
                "selftest_block_sum",
                vec![
                    Arg::input("out", &[0.0f32]),
                    Arg::input("inp", &inp),
                    Arg::I32(32),
                ],
                "(const float*, const float*, int), but",
            ),
            (
                "selftest_mma",
                vec![
                    Arg::output("d", &mut d),
                    Arg::input("a", &[0.0f32; 256]),
                    Arg::input("b", &[0u16; 128]),
                ],
                "(float*, const float*, const unsigned short*), but the kernel's parameters \
                 are (float*, const unsigned short*, const unsigned short*)",
            ),
        ];
        for (kernel, args, want) in cases {
            // SAFETY: every buffer is as long as the kernel indexes (and
            // the launch is refused before it runs).
            let err = unsafe { launch(kernel, grid, block, args) }.unwrap_err();
            assert!(err.contains(want), "{err}");
        }
        assert_eq!((outs, d), ([[0.0]; 2], [0.0; 128]));
        let mut out = [0.0f32];
        let args = vec![
            Arg::output("out", &mut out),
            Arg::input("inp", &inp),
            Arg::I32(32),
        ];
        // SAFETY: as above.
        unsafe { launch("selftest_block_sum", grid, block, args) }.unwrap();
        assert_eq!(out, [32.0]);
    }
}
