//! GPT-2 as Braid tasks: configuration, parameter layout, kernels, data, weights
//! and the data-parallel trainer.
//!
//! # Example
//!
//! Two training steps of the tiny model on the CPU, then its loss on the
//! same tokens and three greedily drawn tokens:
//!
//! ```
//! use braid_gpt2::braid::{BackendKind, Policy};
//! use braid_gpt2::config::Gpt2Config;
//! use braid_gpt2::data::TokenSource;
//! use braid_gpt2::model::{Dtype, ModelOptions, Sampler};
//! use braid_gpt2::trainer::{self, StartState, TrainOptions};
//!
//! # fn main() -> braid_gpt2::error::Result<()> {
//! let cfg = Gpt2Config::tiny();
//! let tokens: Vec<u16> = (0..400).map(|i| (i * 7 % 31) as u16).collect();
//! let data = TokenSource::from_tokens(tokens, "example tokens");
//! let opts = TrainOptions {
//!     model: cfg,
//!     batch_size: 2,
//!     seq_len: 16,
//!     steps: 2,
//!     ranks: 1,
//!     backend: BackendKind::Cpu,
//!     ..TrainOptions::default()
//! };
//! let start = StartState::fresh(&cfg, opts.seed);
//! let report = trainer::train(&opts, start, &data, &|r| {
//!     println!("step {}: loss {:.3}", r.step, r.loss)
//! })?;
//! assert_eq!(report.steps.len(), 2);
//!
//! let rt = trainer::model_runtime(BackendKind::Cpu, 1, Policy::Affinity, 0)?;
//! let opts = ModelOptions::default();
//! let eval = trainer::evaluate(&rt, &cfg, &report.params, &data, 16, 4, opts, |_, _| {})?;
//! println!("eval loss {:.3} over {} tokens", eval.loss, eval.tokens);
//!
//! let mut sampler = Sampler::new(&rt, &cfg, &report.params, 16, 0.0, 1, Dtype::F32)?;
//! let drawn = sampler.generate(&rt, &[0, 7, 14], 3, |_| Ok(()))?;
//! assert_eq!(drawn.len(), 3);
//! # Ok(())
//! # }
//! ```

/// The engine this crate runs on, re-exported so that a user needs no second
/// dependency for [`BackendKind`](braid::BackendKind),
/// [`Policy`](braid::Policy) and the rest.
pub use braid;

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod kernels;
pub mod layout;
pub mod model;
pub mod optim;
pub mod reference;
pub mod rng;
pub mod trainer;
pub mod weights;
