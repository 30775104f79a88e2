//! Tidy: the sans-IO crates stay sans-IO. No async runtime, no I/O, no clock, no randomness in
//! the sources or dependencies of turnstile-core and turnstile-drive (the dispatch driver, which
//! also may not depend on the store), see ARCHITECTURE.md. One test for both, so the rule is
//! written once.

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
];
/// The driver names store operations; the store crate (tokio, databases) runs them.
const FORBIDDEN_FOR_THE_DRIVER: &[&str] = &["turnstile-store"];

/// The sans-IO crates, beside this one: (name, directory, fewest source files expected).
fn crates() -> [(&'static str, std::path::PathBuf, usize); 2] {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf();
    let drive = core.parent().unwrap().join("turnstile-drive");
    [("turnstile-core", core, 5), ("turnstile-drive", drive, 3)]
}

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
fn sans_io_sources_use_no_io_clock_async_or_randomness() {
    for (name, dir, fewest) in crates() {
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        assert!(files.len() >= fewest, "{name}: {} source files", files.len());
        for file in files {
            let source = std::fs::read_to_string(&file).unwrap();
            for (number, line) in source.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for word in identifiers(code) {
                    assert!(
                        !FORBIDDEN_WORDS.contains(&word),
                        "{}:{}: `{word}` has no place in sans-IO {name}: {line}",
                        file.display(),
                        number + 1
                    );
                }
            }
        }
    }
}

#[test]
fn sans_io_crates_depend_on_no_runtime_io_or_randomness_crate() {
    for (name, dir, _) in crates() {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let dependencies = manifest.split("[dev-dependencies]").next().unwrap();
        for line in dependencies.lines() {
            let dependency = line.split(['=', '.', ' ']).next().unwrap_or("").trim();
            assert!(
                !FORBIDDEN_DEPENDENCIES.contains(&dependency)
                    && !(name == "turnstile-drive" && FORBIDDEN_FOR_THE_DRIVER.contains(&dependency)),
                "{name} must not depend on {dependency}"
            );
        }
    }
}
