//! The GPT-2 kernel families of `models/gpt2/src/kernels`, a module per
//! `.cu` file (flash_attention.cu and flash_attention_tc.cu share one): the
//! wrappers (`(grid, block, the kernel's arguments)`, lengths checked, every
//! buffer guarded, bf16 as `u16` bits), re-exported at the crate root.
//!
//! Each wrapper documents the launch configuration of its Rust launcher in
//! `models/gpt2/src/kernels/<family>.rs`, which the tests reproduce; the
//! wrappers check what memory safety needs (every index the kernel can form
//! is inside its buffer, for any grid and block), not that the configuration
//! is the launcher's.

/// The f32 and the bf16 wrapper of one kernel, from one parameter list and
/// one body:
///
/// ```text
/// twins! {
///     /// `gelu_forward` (f32): ...
///     pub fn gelu_forward(S = f32);
///     /// [`gelu_forward`] with bf16 storage.
///     pub fn gelu_forward_bf16(S = u16);
///     fn(k, grid: Dim3, block: Dim3, out: &mut [S], inp: &[S], n: i64) {
///         // ... with `k` the kernel's name
///     }
/// }
/// ```
///
/// defines `pub fn gelu_forward(grid: Dim3, block: Dim3, out: &mut [f32],
/// inp: &[f32], n: i64) -> Result<(), String>` with the first doc comment,
/// and `gelu_forward_bf16` with `u16` for `S` and the second, each running
/// the body with `k` its own name (the kernel's, as in the `.cu` file). `S`
/// is replaced in parameters typed `&mut [S]`, `&[S]`, `Option<&[S]>` or
/// `Option<&mut [S]>`;
/// other parameters keep their types.
macro_rules! twins {
    (
        $(#[$doc_a:meta])* pub fn $a:ident(S = $ea:ident);
        $(#[$doc_b:meta])* pub fn $b:ident(S = $eb:ident);
        fn($k:ident, $($params:tt)*) $body:block
    ) => {
        twins!(@fn [$(#[$doc_a])*] $a $ea $k [] [$($params)*] $body);
        twins!(@fn [$(#[$doc_b])*] $b $eb $k [] [$($params)*] $body);
    };
    // The parameters one at a time, `S` replaced by the element type `$e`.
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: &mut [S] $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: &mut [$e],] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: &[S] $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: &[$e],] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: Option<&[S]> $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: Option<&[$e]>,] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: Option<&mut [S]> $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: Option<&mut [$e]>,] [$($($rest)*)?] $body);
    };
    (@fn $doc:tt $name:ident $e:ident $k:ident [$($done:tt)*]
        [$p:ident: $t:ty $(, $($rest:tt)*)?] $body:block) => {
        twins!(@fn $doc $name $e $k [$($done)* $p: $t,] [$($($rest)*)?] $body);
    };
    (@fn [$($doc:tt)*] $name:ident $e:ident $k:ident [$($done:tt)*] [] $body:block) => {
        $($doc)*
        pub fn $name($($done)*) -> Result<(), String> {
            let $k = stringify!($name);
            $body
        }
    };
}

mod adamw;
mod attention;
mod encoder;
mod flash_attention;
mod gelu;
mod layernorm;
mod loss;
mod matmul;
mod norm;
mod residual;

pub use adamw::*;
pub use attention::*;
pub use encoder::*;
pub use flash_attention::*;
pub use gelu::*;
pub use layernorm::*;
pub use loss::*;
pub use matmul::*;
pub use norm::*;
pub use residual::*;
