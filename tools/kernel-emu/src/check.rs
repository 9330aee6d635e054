//! The shape checks the wrappers share: each returns an error naming the
//! kernel and what is wrong.

use crate::Dim3;

/// `len` is `want`.
pub(crate) fn need(kernel: &str, name: &str, len: usize, want: usize) -> Result<(), String> {
    if len == want {
        Ok(())
    } else {
        Err(format!(
            "{kernel}: {name} has {len} elements, expected {want}"
        ))
    }
}

/// `len` is at least `want`.
pub(crate) fn need_at_least(
    kernel: &str,
    name: &str,
    len: usize,
    want: usize,
) -> Result<(), String> {
    if len >= want {
        Ok(())
    } else {
        Err(format!(
            "{kernel}: {name} has {len} elements, expected at least {want}"
        ))
    }
}

/// The product of `dims`, unless it overflows.
pub(crate) fn product(kernel: &str, dims: &[usize]) -> Result<usize, String> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("{kernel}: sizes overflow"))
}

/// A size the kernel takes as an `int`: not negative.
pub(crate) fn nonneg(kernel: &str, x: i32) -> Result<usize, String> {
    usize::try_from(x).map_err(|_| format!("{kernel}: negative size {x}"))
}

/// A dimension the kernel divides by or takes as a row width: at least 1
/// (as the launchers' `Check::dim` requires).
pub(crate) fn dim(kernel: &str, name: &str, x: i32) -> Result<usize, String> {
    match nonneg(kernel, x)? {
        0 => Err(format!("{kernel}: {name} is 0")),
        d => Ok(d),
    }
}

/// A 64-bit element count (the `long long N` of the elementwise kernels).
pub(crate) fn count(kernel: &str, x: i64) -> Result<usize, String> {
    usize::try_from(x).map_err(|_| format!("{kernel}: negative size {x}"))
}

/// A row stride: at least the row's used width (`Check::stride`).
pub(crate) fn stride(
    kernel: &str,
    name: &str,
    ld: i32,
    width: &str,
    w: usize,
) -> Result<usize, String> {
    let s = dim(kernel, name, ld)?;
    if s < w {
        return Err(format!(
            "{kernel}: row stride {name} ({s}) is below {width} ({w})"
        ));
    }
    Ok(s)
}

/// Every id in `ids` is below `bound` (the kernels index rows with them).
pub(crate) fn ids_below(kernel: &str, name: &str, ids: &[u32], bound: usize) -> Result<(), String> {
    match ids.iter().position(|&i| i as usize >= bound) {
        None => Ok(()),
        Some(p) => Err(format!(
            "{kernel}: {name}[{p}] = {} is not below {bound}",
            ids[p]
        )),
    }
}

/// Threads of a one-dimensional launch (the self-test kernels index by `.x`
/// only).
pub(crate) fn threads_1d(kernel: &str, grid: Dim3, block: Dim3) -> Result<usize, String> {
    if (grid.1, grid.2, block.1, block.2) != (1, 1, 1, 1) {
        return Err(format!(
            "{kernel}: expects a one-dimensional grid and block"
        ));
    }
    product(kernel, &[grid.0 as usize, block.0 as usize])
}
