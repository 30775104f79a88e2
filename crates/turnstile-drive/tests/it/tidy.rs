//! Tidy: turnstile-drive stays sans-IO. No async runtime, no I/O, no clock, no randomness in its
//! sources or its dependencies (see ARCHITECTURE.md).

use std::path::Path;

const FORBIDDEN_WORDS: &[&str] = &[
    "tokio",
    "async",
    "await",
    "fs",
    "net",
    "process",
    "env",
    "Instant",
    "SystemTime",
    "UNIX_EPOCH",
    "rand",
    "getrandom",
    "thread",
    "stdin",
    "stdout",
    "println",
    "eprintln",
    "File",
    "TcpStream",
    "sleep",
];
const FORBIDDEN_DEPENDENCIES: &[&str] = &[
    "tokio",
    "rand",
    "getrandom",
    "reqwest",
    "rusqlite",
    "tokio-postgres",
    "hyper",
    "axum",
    "mio",
    // The store crate runs tokio and the databases; the driver only names its operations.
    "turnstile-store",
];

fn identifiers(source: &str) -> impl Iterator<Item = &str> {
    source
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|word| !word.is_empty())
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn drive_sources_use_no_io_clock_async_or_randomness() {
    let mut files = Vec::new();
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    assert!(files.len() >= 3);
    for file in files {
        let source = std::fs::read_to_string(&file).unwrap();
        for (number, line) in source.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in identifiers(code) {
                assert!(
                    !FORBIDDEN_WORDS.contains(&word),
                    "{}:{}: `{word}` has no place in the sans-IO driver: {line}",
                    file.display(),
                    number + 1
                );
            }
        }
    }
}

#[test]
fn drive_depends_on_no_runtime_io_or_randomness_crate() {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let dependencies = manifest.split("[dev-dependencies]").next().unwrap();
    for line in dependencies.lines() {
        let name = line.split(['=', '.', ' ']).next().unwrap_or("").trim();
        assert!(
            !FORBIDDEN_DEPENDENCIES.contains(&name),
            "turnstile-drive must not depend on {name}"
        );
    }
}
