//! `braid`: tools for Braid programs. `braid top` shows what every stream of
//! a program is doing, live (over the socket `BRAID_LIVE` names) or from a
//! Chrome trace it wrote.

mod top;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "braid", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What every rank and stream is running: live, or replayed from a trace.
    Top(top::TopArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Top(args) => top::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("braid: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
