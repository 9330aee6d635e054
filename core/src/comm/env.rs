//! Where this process sits in a distributed run: torchrun's environment.
//!
//! [`DistEnv::from_env`] reads the variables `torchrun` sets: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
//! With neither `RANK` nor `WORLD_SIZE` set it is a single-process run (rank 0
//! of 1; [`DistEnv::launched`] says `None`). Missing
//! `LOCAL_RANK`/`LOCAL_WORLD_SIZE` default to `RANK`/`WORLD_SIZE` (one node);
//! `MASTER_ADDR` defaults to `127.0.0.1` and `MASTER_PORT` to 29500 (torchrun's
//! default). A half-set or inconsistent environment is an error naming the
//! variable.

use super::rendezvous::RendezvousConfig;

/// `MASTER_ADDR` when unset.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// `MASTER_PORT` when unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A bad or inconsistent distributed environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A variable is set but unusable.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A variable is required because another one is set.
    #[error("environment variable {var} is not set, but {because} is (torchrun sets both)")]
    Missing {
        /// The missing variable.
        var: &'static str,
        /// The variable that requires it.
        because: &'static str,
    },
}

/// Where this process sits in a distributed run (torchrun's variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within this node: the GPU ordinal to use.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
}

impl Default for DistEnv {
    fn default() -> Self {
        Self::single()
    }
}

fn parse_num<T: std::str::FromStr>(var: &'static str, value: String) -> Result<T, EnvError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse::<T>().map_err(|e| EnvError::Invalid {
        var,
        value: value.clone(),
        reason: e.to_string(),
    })
}

impl DistEnv {
    /// Rank 0 of 1 on `127.0.0.1:29500`.
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: DEFAULT_MASTER_PORT,
        }
    }

    /// Reads the process environment ([`DistEnv::single`] when neither `RANK`
    /// nor `WORLD_SIZE` is set).
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        Ok(Self::launched_from_vars(get)?.unwrap_or_else(Self::single))
    }

    /// Reads the process environment; `None` when neither `RANK` nor
    /// `WORLD_SIZE` is set (the process was not launched by torchrun).
    pub fn launched() -> Result<Option<Self>, EnvError> {
        Self::launched_from_vars(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::launched`], reading variables through `get`.
    pub fn launched_from_vars(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, EnvError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let (rank, world_size) = match (get("RANK"), get("WORLD_SIZE")) {
            (None, None) => return Ok(None),
            (Some(_), None) => {
                return Err(EnvError::Missing {
                    var: "WORLD_SIZE",
                    because: "RANK",
                })
            }
            (None, Some(_)) => {
                return Err(EnvError::Missing {
                    var: "RANK",
                    because: "WORLD_SIZE",
                })
            }
            (Some(r), Some(w)) => (
                parse_num::<usize>("RANK", r)?,
                parse_num::<usize>("WORLD_SIZE", w)?,
            ),
        };
        if world_size == 0 {
            return Err(EnvError::Invalid {
                var: "WORLD_SIZE",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(EnvError::Invalid {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("must be less than WORLD_SIZE={world_size}"),
            });
        }
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(v) => parse_num::<usize>("LOCAL_WORLD_SIZE", v)?,
            None => world_size,
        };
        if local_world_size == 0 || local_world_size > world_size {
            return Err(EnvError::Invalid {
                var: "LOCAL_WORLD_SIZE",
                value: local_world_size.to_string(),
                reason: format!("must be in 1..={world_size} (WORLD_SIZE)"),
            });
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse_num::<usize>("LOCAL_RANK", v)?,
            None => rank % local_world_size,
        };
        if local_rank >= local_world_size {
            return Err(EnvError::Invalid {
                var: "LOCAL_RANK",
                value: local_rank.to_string(),
                reason: format!("must be less than LOCAL_WORLD_SIZE={local_world_size}"),
            });
        }
        let master_addr = get("MASTER_ADDR")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| DEFAULT_MASTER_ADDR.into());
        let master_port = match get("MASTER_PORT") {
            Some(v) => {
                let p = parse_num::<u16>("MASTER_PORT", v.clone())?;
                if p == 0 {
                    return Err(EnvError::Invalid {
                        var: "MASTER_PORT",
                        value: v,
                        reason: "port 0 is not a rendezvous port".into(),
                    });
                }
                p
            }
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        }))
    }

    /// True when more than one rank takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed).
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The rendezvous configuration for this process, default timeouts.
    pub fn rendezvous_config(&self) -> RendezvousConfig {
        RendezvousConfig::new(self.master_endpoint(), self.rank, self.world_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn env_single_process_defaults() {
        let e = DistEnv::from_vars(vars(&[])).unwrap();
        assert_eq!(e, DistEnv::single());
        assert!(!e.is_distributed());
        assert_eq!(e.master_endpoint(), "127.0.0.1:29500");
        assert_eq!(DistEnv::launched_from_vars(vars(&[])).unwrap(), None);
    }

    #[test]
    fn env_torchrun_variables() {
        let e = DistEnv::from_vars(vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(e.master_endpoint(), "node0:1234");
        assert!(e.is_distributed());
        let v6 = DistEnv {
            master_addr: "::1".into(),
            ..e
        };
        assert_eq!(v6.master_endpoint(), "[::1]:1234");
        // LOCAL_* default to one node.
        let e = DistEnv::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "3")])).unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (2, 3));
    }

    #[test]
    fn env_errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "1")], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "2")],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")],
                "MASTER_PORT",
            ),
        ];
        for (pairs, var) in cases {
            let err = DistEnv::from_vars(vars(pairs)).unwrap_err();
            assert!(err.to_string().contains(var), "{pairs:?}: {err}");
        }
    }
}
