//! cuDNN's backend (graph) API, called through function pointers looked up
//! in the library cudarc loads (`cudarc::cudnn::sys::culib`).
//!
//! cudarc's generated bindings take and return Rust enums. A newer cuDNN may
//! return a status, or accept an attribute, that the bindings' enum does
//! not list, and an out-of-range enum value is undefined behaviour in Rust.
//! So the dozen entry points used here are declared with plain integers
//! (`u32` for an enum argument, `i32` for a status: the C enums are `int`
//! sized), and cudarc's enums only supply the numbers (`X as u32`), which
//! cuDNN keeps stable across its versions.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use cudarc::cudnn::sys;

use crate::error::{catch_panic, CudaError, CudaResult};

/// A backend descriptor handle (`cudnnBackendDescriptor_t`).
pub(super) type RawDesc = *mut c_void;
/// A library handle (`cudnnHandle_t`).
pub(super) type RawHandle = *mut c_void;

/// The entry points, looked up once.
pub(super) struct Api {
    pub(super) version: unsafe extern "C" fn() -> usize,
    pub(super) create: unsafe extern "C" fn(*mut RawHandle) -> i32,
    pub(super) destroy: unsafe extern "C" fn(RawHandle) -> i32,
    pub(super) set_stream: unsafe extern "C" fn(RawHandle, *mut c_void) -> i32,
    error_string: unsafe extern "C" fn(i32) -> *const c_char,
    last_error: Option<unsafe extern "C" fn(*mut c_char, usize)>,
    desc_create: unsafe extern "C" fn(u32, *mut RawDesc) -> i32,
    desc_destroy: unsafe extern "C" fn(RawDesc) -> i32,
    set_attr: unsafe extern "C" fn(RawDesc, u32, u32, i64, *const c_void) -> i32,
    get_attr: unsafe extern "C" fn(RawDesc, u32, u32, i64, *mut i64, *mut c_void) -> i32,
    finalize: unsafe extern "C" fn(RawDesc) -> i32,
    pub(super) execute: unsafe extern "C" fn(RawHandle, RawDesc, RawDesc) -> i32,
}

/// True when cuDNN (`libcudnn.so.9`) can be loaded. Cached.
pub fn cudnn_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate
        // names; it has no other precondition.
        std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

/// The entry points, or why there are none.
pub(super) fn api() -> CudaResult<&'static Api> {
    static API: OnceLock<Result<Api, CudaError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> CudaResult<Api> {
    if !cudnn_library_present() {
        return Err(CudaError::LibraryMissing {
            library: "libcudnn",
            what: "dlopen of libcudnn.so / libcudnn.so.9 failed".into(),
            hint: "install the nvidia-cudnn-cu13 wheel (cuDNN 9) and add its lib directory to \
                   LD_LIBRARY_PATH",
        });
    }
    catch_panic("loading cuDNN", || {
        // SAFETY: the library is present (checked above; `culib` loads it
        // once and keeps it for the process). Each symbol is the cuDNN 9
        // function of that name, whose C signature the field's type spells
        // with integers for its enums (module docs).
        let lib = unsafe { sys::culib() };
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: as above.
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(e) => {
                        return Err(CudaError::LibraryMissing {
                            library: "libcudnn",
                            what: format!("symbol {} not found: {e}", $name),
                            hint: "cuDNN 9 is needed (the nvidia-cudnn-cu13 wheel)",
                        })
                    }
                }
            };
        }
        Ok(Api {
            version: sym!("cudnnGetVersion"),
            create: sym!("cudnnCreate"),
            destroy: sym!("cudnnDestroy"),
            set_stream: sym!("cudnnSetStream"),
            error_string: sym!("cudnnGetErrorString"),
            // SAFETY: as above; absent before cuDNN 9.0.
            last_error: unsafe { lib.get(b"cudnnGetLastErrorString\0") }
                .ok()
                .map(|s| *s),
            desc_create: sym!("cudnnBackendCreateDescriptor"),
            desc_destroy: sym!("cudnnBackendDestroyDescriptor"),
            set_attr: sym!("cudnnBackendSetAttribute"),
            get_attr: sym!("cudnnBackendGetAttribute"),
            finalize: sym!("cudnnBackendFinalize"),
            execute: sym!("cudnnBackendExecute"),
        })
    })
}

/// cuDNN's version as `major·10000 + minor·100 + patch` (9.13.0 is 91300).
pub(super) fn version() -> CudaResult<usize> {
    let api = api()?;
    // SAFETY: no arguments, no preconditions.
    Ok(unsafe { (api.version)() })
}

/// Turns a status into a [`CudaError::Cudnn`] naming `call`, with cuDNN's
/// name for the status and its last error message.
pub(super) fn check(status: i32, call: &'static str, what: &str) -> CudaResult<()> {
    if status == 0 {
        return Ok(());
    }
    let api = api()?;
    // SAFETY: any status value is accepted; the string is static.
    let name = unsafe { (api.error_string)(status) };
    let name = if name.is_null() {
        format!("status {status}")
    } else {
        // SAFETY: a non-null, NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    let detail = api.last_error.map(|f| {
        let mut buf = vec![0 as c_char; 1024];
        // SAFETY: `buf` holds `buf.len()` bytes; cuDNN writes a
        // NUL-terminated message of at most that size.
        unsafe { f(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: NUL-terminated within `buf` (zeroed, and cuDNN terminates).
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .trim()
            .to_string()
    });
    Err(CudaError::Cudnn {
        call,
        what: what.to_string(),
        status: name,
        message: detail.unwrap_or_default(),
    })
}

/// One owned backend descriptor, destroyed in `Drop`.
pub(super) struct Desc {
    raw: RawDesc,
    api: &'static Api,
}

// SAFETY: a descriptor is plain library memory with no thread affinity; the
// plan cache uses them under its mutex.
unsafe impl Send for Desc {}
// SAFETY: as above.
unsafe impl Sync for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by `cudnnBackendCreateDescriptor`, destroyed once.
        unsafe { (self.api.desc_destroy)(self.raw) };
    }
}

/// An attribute value: its cuDNN attribute type and elements.
pub(super) enum Value<'a> {
    I64(&'a [i64]),
    F32(f32),
    Bool(bool),
    /// An enum value of the given attribute type (C enums are `int`
    /// sized): made by [`Value::data_type`], [`Value::pointwise`],
    /// [`Value::reduction`] and [`Value::heur`].
    Enum(sys::cudnnBackendAttributeType_t, u32),
    Descs(&'a [&'a Desc]),
    Handle(RawHandle),
    Ptrs(&'a [*mut c_void]),
}

impl Value<'_> {
    /// A `cudnnDataType_t`.
    pub(super) fn data_type(v: sys::cudnnDataType_t) -> Self {
        Value::Enum(
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_DATA_TYPE,
            v as u32,
        )
    }

    /// A `cudnnPointwiseMode_t`.
    pub(super) fn pointwise(v: sys::cudnnPointwiseMode_t) -> Self {
        Value::Enum(
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_POINTWISE_MODE,
            v as u32,
        )
    }

    /// A `cudnnReduceTensorOp_t`.
    pub(super) fn reduction(v: sys::cudnnReduceTensorOp_t) -> Self {
        let ty = sys::cudnnBackendAttributeType_t::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE;
        Value::Enum(ty, v as u32)
    }

    /// A `cudnnBackendHeurMode_t`.
    pub(super) fn heur(v: sys::cudnnBackendHeurMode_t) -> Self {
        Value::Enum(
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_HEUR_MODE,
            v as u32,
        )
    }
}

impl Desc {
    /// A new descriptor of type `ty` (a `cudnnBackendDescriptorType_t`).
    pub(super) fn new(ty: sys::cudnnBackendDescriptorType_t) -> CudaResult<Desc> {
        let api = api()?;
        let mut raw: RawDesc = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        let st = unsafe { (api.desc_create)(ty as u32, &mut raw) };
        check(st, "cudnnBackendCreateDescriptor", &format!("{ty:?}"))?;
        Ok(Desc { raw, api })
    }

    pub(super) fn raw(&self) -> RawDesc {
        self.raw
    }

    /// Sets attribute `name` (a `cudnnBackendAttributeName_t`, by number).
    pub(super) fn set(&self, name: u32, value: Value<'_>) -> CudaResult<&Self> {
        use sys::cudnnBackendAttributeType_t as T;
        let descs: Vec<RawDesc>;
        let (ty, n, ptr): (u32, usize, *const c_void) = match &value {
            Value::I64(v) => (T::CUDNN_TYPE_INT64 as u32, v.len(), v.as_ptr().cast()),
            Value::F32(v) => (T::CUDNN_TYPE_FLOAT as u32, 1, (v as *const f32).cast()),
            Value::Bool(v) => (T::CUDNN_TYPE_BOOLEAN as u32, 1, (v as *const bool).cast()),
            Value::Enum(ty, v) => (*ty as u32, 1, (v as *const u32).cast()),
            Value::Descs(d) => {
                descs = d.iter().map(|d| d.raw).collect();
                (
                    T::CUDNN_TYPE_BACKEND_DESCRIPTOR as u32,
                    descs.len(),
                    descs.as_ptr().cast(),
                )
            }
            Value::Handle(h) => (
                T::CUDNN_TYPE_HANDLE as u32,
                1,
                (h as *const RawHandle).cast(),
            ),
            Value::Ptrs(p) => (T::CUDNN_TYPE_VOID_PTR as u32, p.len(), p.as_ptr().cast()),
        };
        // SAFETY: `ptr` points to `n` elements of the type `ty` names, alive
        // for the call (cuDNN copies them); the descriptor is live.
        let st = unsafe { (self.api.set_attr)(self.raw, name, ty, n as i64, ptr) };
        check(st, "cudnnBackendSetAttribute", &format!("attribute {name}"))?;
        Ok(self)
    }

    /// Finalizes the descriptor; `what` names it in an error.
    pub(super) fn finalize(self, what: &str) -> CudaResult<Desc> {
        // SAFETY: a live descriptor.
        let st = unsafe { (self.api.finalize)(self.raw) };
        check(st, "cudnnBackendFinalize", what)?;
        Ok(self)
    }

    /// An `INT64` attribute of a finalized descriptor.
    pub(super) fn get_i64(&self, name: u32) -> CudaResult<i64> {
        use sys::cudnnBackendAttributeType_t as T;
        let (mut v, mut n) = (0i64, 0i64);
        // SAFETY: room for one element; the descriptor is live.
        let st = unsafe {
            (self.api.get_attr)(
                self.raw,
                name,
                T::CUDNN_TYPE_INT64 as u32,
                1,
                &mut n,
                (&mut v as *mut i64).cast(),
            )
        };
        check(st, "cudnnBackendGetAttribute", &format!("attribute {name}"))?;
        Ok(v)
    }

    /// How many elements attribute `name` (of type `ty`) holds.
    pub(super) fn count(&self, name: u32, ty: u32) -> CudaResult<i64> {
        let mut n = 0i64;
        // SAFETY: a count query: no elements are written.
        let st =
            unsafe { (self.api.get_attr)(self.raw, name, ty, 0, &mut n, std::ptr::null_mut()) };
        check(
            st,
            "cudnnBackendGetAttribute",
            &format!("count of attribute {name}"),
        )?;
        Ok(n)
    }

    /// Fills the (created, not finalized) descriptors `out` from a
    /// descriptor-array attribute; how many were filled.
    pub(super) fn get_descs(&self, name: u32, out: &[Desc]) -> CudaResult<usize> {
        use sys::cudnnBackendAttributeType_t as T;
        let mut raws: Vec<RawDesc> = out.iter().map(|d| d.raw).collect();
        let mut n = 0i64;
        // SAFETY: `raws` holds `out.len()` live descriptors for cuDNN to fill.
        let st = unsafe {
            (self.api.get_attr)(
                self.raw,
                name,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR as u32,
                raws.len() as i64,
                &mut n,
                raws.as_mut_ptr().cast(),
            )
        };
        check(st, "cudnnBackendGetAttribute", &format!("attribute {name}"))?;
        Ok(n.max(0) as usize)
    }
}
