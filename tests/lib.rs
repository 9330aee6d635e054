//! Workspace-level integration tests live in `tests/` beside this file: they
//! exercise the engine, the collectives and the GPT-2 trainer together, the
//! way a user of all three crates would.
