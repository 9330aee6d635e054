//! GPT-2 as Braid tasks: configuration, parameter layout, kernels, data, weights
//! and the data-parallel trainer.

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
