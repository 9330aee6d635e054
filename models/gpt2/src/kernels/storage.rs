//! The element a CPU kernel stores: `f32` or bfloat16 ([`Bf16`]).
//!
//! Mixed precision as llm.c does it: tensors are *stored* in the storage
//! type, and every kernel *computes* in `f32` (row reductions in `f64`, as
//! before): it loads each element to `f32` ([`Storage::load`]), computes, and
//! rounds once as it stores ([`Storage::store`], round to nearest, ties to
//! even). A kernel that accumulates into a gradient (`+=`) loads the gradient,
//! adds every contribution in `f32` and rounds once at the end, so a bf16
//! gradient is the rounding of what the `f32` kernel would have computed from
//! the same inputs.
//!
//! For `f32` both conversions are the identity and the slice helpers borrow,
//! so the `f32` kernels are the kernels they were, bit for bit.

use std::borrow::Cow;

pub use braid::comm::Bf16;

/// A storage data type of the model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dtype {
    /// 32-bit float storage.
    #[default]
    F32,
    /// bfloat16 storage, `f32` computation.
    Bf16,
}

impl Dtype {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    /// The name the command line uses (`fp32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "fp32",
            Dtype::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;

    /// `fp32` (or `f32`) and `bf16`.
    fn from_str(s: &str) -> Result<Dtype, String> {
        match s {
            "fp32" | "f32" => Ok(Dtype::F32),
            "bf16" => Ok(Dtype::Bf16),
            other => Err(format!("unknown dtype `{other}` (expected fp32 or bf16)")),
        }
    }
}

/// An element type the CPU kernels store: loads to `f32`, stores from `f32`.
pub trait Storage: bytemuck::Pod + Send + Sync + 'static {
    /// The matching [`Dtype`].
    const DTYPE: Dtype;

    /// The exact `f32` value.
    fn load(self) -> f32;

    /// `x` rounded to this type (to nearest, ties to even; exact for `f32`).
    fn store(x: f32) -> Self;

    /// The slice as `f32`: borrowed for `f32`, converted otherwise.
    fn load_slice(s: &[Self]) -> Cow<'_, [f32]>;

    /// Runs `f` on the slice as `f32` and stores the result back: in place for
    /// `f32`; otherwise on a converted copy, rounded once at the end.
    fn update_f32<R>(s: &mut [Self], f: impl FnOnce(&mut [f32]) -> R) -> R;
}

impl Storage for f32 {
    const DTYPE: Dtype = Dtype::F32;

    #[inline(always)]
    fn load(self) -> f32 {
        self
    }

    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }

    fn load_slice(s: &[f32]) -> Cow<'_, [f32]> {
        Cow::Borrowed(s)
    }

    fn update_f32<R>(s: &mut [f32], f: impl FnOnce(&mut [f32]) -> R) -> R {
        f(s)
    }
}

impl Storage for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;

    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }

    #[inline(always)]
    fn store(x: f32) -> Bf16 {
        Bf16::from_f32(x)
    }

    fn load_slice(s: &[Bf16]) -> Cow<'_, [f32]> {
        Cow::Owned(s.iter().map(|x| x.to_f32()).collect())
    }

    fn update_f32<R>(s: &mut [Bf16], f: impl FnOnce(&mut [f32]) -> R) -> R {
        let mut wide: Vec<f32> = s.iter().map(|x| x.to_f32()).collect();
        let r = f(&mut wide);
        for (d, &x) in s.iter_mut().zip(&wide) {
            *d = Bf16::from_f32(x);
        }
        r
    }
}

/// `src` converted element by element (rounded when narrowing).
pub fn convert<A: Storage, B: Storage>(dst: &mut [B], src: &[A]) {
    assert_eq!(dst.len(), src.len(), "convert: lengths differ");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = B::store(s.load());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_is_the_identity_and_bf16_rounds_to_nearest_even() {
        for x in [0.0f32, -1.5, 3.1e-12, f32::MAX, f32::MIN_POSITIVE] {
            assert_eq!(f32::store(x).load().to_bits(), x.to_bits());
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
        assert_eq!(Bf16::store(1.0 + 1.0 / 256.0).load(), 1.0);
        // Just above halfway rounds up.
        assert_eq!(
            Bf16::store(1.0 + 1.0 / 256.0 + 1.0 / 65536.0).load(),
            1.0 + 1.0 / 128.0
        );
        assert!(Bf16::store(f32::NAN).load().is_nan());
    }

    #[test]
    fn update_f32_rounds_once_at_the_end() {
        // Adding 2^-9 to 1.0 eight times: rounding after each add would
        // leave 1.0 (each add is below half an ulp); rounding once gives
        // 1 + 2^-6.
        let mut s = [Bf16::store(1.0)];
        Bf16::update_f32(&mut s, |w| {
            for _ in 0..8 {
                w[0] += 1.0 / 512.0;
            }
        });
        assert_eq!(s[0].load(), 1.0 + 1.0 / 64.0);
        let mut f = [1.0f32];
        f32::update_f32(&mut f, |w| w[0] += 0.5);
        assert_eq!(f[0], 1.5);
        assert!(matches!(f32::load_slice(&f), Cow::Borrowed(_)));
    }

    #[test]
    fn dtype_parses_and_names_itself() {
        assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::Bf16));
        assert_eq!("fp32".parse::<Dtype>(), Ok(Dtype::F32));
        let err = "fp16".parse::<Dtype>().unwrap_err();
        assert!(err.contains("fp16") && err.contains("bf16"), "{err}");
        assert_eq!(Dtype::Bf16.size(), 2);
        assert_eq!(Dtype::default().to_string(), "fp32");
    }
}
