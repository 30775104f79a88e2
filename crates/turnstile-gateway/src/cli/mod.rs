//! Subcommands and the one table that maps outcomes to exit statuses
//! (`shared/spec/conversation-v1.md` §3).

pub mod assemble;
pub mod render;
pub mod repair;
pub mod serve;
pub mod sim;
pub mod validate;

use std::io::Read;
use std::process::ExitCode;
use turnstile_core::limits;

/// Every exit status the CLI uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Ready / rendered / committed.
    Ok,
    /// Rejected by the validator.
    Rejected,
    /// Unreadable input or a usage error.
    Usage,
    /// Waiting for tool results.
    Waiting,
    /// `assemble`: nothing would be committed (cut stream, missing stop, invalid block).
    NothingCommitted,
    /// `render`: the adapter version cannot represent a block kind (never a lossy fallback).
    Paused,
    /// `render`: prompt tokens plus the output cap exceed the model's context window.
    OverBudget,
    /// `serve`: the configuration (file, flags, or an environment variable it names) is
    /// unusable (sysexits' `EX_CONFIG`).
    Config,
    /// `serve`: the store cannot be reached, refused us, or failed start-up recovery
    /// (sysexits' `EX_UNAVAILABLE`).
    Store,
    /// `serve`: the listening socket could not be opened or served (sysexits' `EX_OSERR`).
    Listen,
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(match exit {
            Exit::Ok => 0,
            Exit::Rejected => 1,
            Exit::Usage => 2,
            Exit::Waiting => 3,
            Exit::Paused => 4,
            Exit::OverBudget => 5,
            Exit::NothingCommitted => 6,
            Exit::Store => 69,
            Exit::Listen => 71,
            Exit::Config => 78,
        })
    }
}

/// Read a file argument (`-` is standard input), refusing more than `FILE_BYTES_MAX` bytes
/// without reading them all.
pub fn read_input(path: &str) -> Result<Vec<u8>, String> {
    let limit = limits::FILE_BYTES_MAX as u64 + 1;
    let mut bytes = Vec::new();
    let result = if path == "-" {
        std::io::stdin().lock().take(limit).read_to_end(&mut bytes)
    } else {
        std::fs::File::open(path).and_then(|file| file.take(limit).read_to_end(&mut bytes))
    };
    result.map_err(|error| format!("cannot read {path}: {error}"))?;
    if bytes.len() > limits::FILE_BYTES_MAX {
        return Err(format!(
            "{path}: limit exceeded: FILE_BYTES_MAX is {} bytes",
            limits::FILE_BYTES_MAX
        ));
    }
    Ok(bytes)
}
