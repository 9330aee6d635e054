//! The kernels' environment switches, checked in one place.
//!
//! Each switch is read once, where the kernels need it. A value it does not
//! know there would be read as its default, so a run could time the default
//! under a name that says otherwise. [`check_environment`] refuses such a
//! value first, naming the variable and the values it takes. The trainer
//! (`braid-gpt2`, every command) and the GPT-2 benchmarks call it before
//! anything runs.

use super::flash_attention::{attention_from_env, DQ_GEMM_ENV};
use super::matmul::{BIAS_EPILOGUE_ENV, GELU_EPILOGUE_ENV};
use crate::error::{Gpt2Error, Result};

/// Each switch with the values it takes. Empty is the same as unset.
/// [`ATTENTION_ENV`](super::flash_attention::ATTENTION_ENV) is checked
/// too, by its own parser.
pub const ENV_SWITCHES: [(&str, &[&str]); 4] = [
    (BIAS_EPILOGUE_ENV, &["0", "1"]),
    (GELU_EPILOGUE_ENV, &["0", "1", "2"]),
    (DQ_GEMM_ENV, &["kernel", "gemm"]),
    (
        braid::cuda::cudnn::SDPA_ENV,
        &braid::cuda::cudnn::SDPA_CHOICES,
    ),
];

/// Checks every switch of [`ENV_SWITCHES`] and
/// [`ATTENTION_ENV`](super::flash_attention::ATTENTION_ENV) as the
/// process's environment sets it.
pub fn check_environment() -> Result<()> {
    check_switches(|k| std::env::var_os(k))?;
    attention_from_env().map_err(|reason| Gpt2Error::InvalidSetting {
        what: "environment variable",
        reason,
    })?;
    Ok(())
}

/// [`ENV_SWITCHES`] against the values `get` gives.
fn check_switches(get: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<()> {
    for (var, takes) in ENV_SWITCHES {
        let Some(v) = get(var).filter(|v| !v.is_empty()) else {
            continue;
        };
        if !v.to_str().is_some_and(|v| takes.contains(&v)) {
            return Err(Gpt2Error::InvalidSetting {
                what: "environment variable",
                reason: format!("{var}={v:?}: expected one of {}", takes.join(", ")),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(set: &[(&str, &str)]) -> Result<()> {
        check_switches(|k| set.iter().find(|(var, _)| *var == k).map(|(_, v)| v.into()))
    }

    #[test]
    fn known_values_pass_and_others_name_the_variable_and_its_values() {
        assert!(check(&[]).is_ok());
        for (var, takes) in ENV_SWITCHES {
            for v in takes.iter().chain(&[""]) {
                assert!(check(&[(var, v)]).is_ok(), "{var}={v}");
            }
            let e = check(&[(var, "on")]).unwrap_err().to_string();
            assert!(e.contains(var) && e.contains("\"on\""), "{e}");
            assert!(takes.iter().all(|t| e.contains(t)), "{e}");
        }
    }
}
