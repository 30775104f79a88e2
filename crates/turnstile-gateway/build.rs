//! Stamps the binary with the commit it was built from (`turnstile --version`, the image's
//! labels). `TURNSTILE_COMMIT` wins (a build from a source tarball, or a packager who knows
//! better); otherwise `git rev-parse` in the source tree; otherwise "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

/// Tell cargo to build again when `file` changes; only for a file that exists (cargo builds
/// again every time for one that does not).
fn watch(file: &str) {
    if std::path::Path::new(file).exists() {
        println!("cargo:rerun-if-changed={file}");
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=TURNSTILE_COMMIT");
    let commit = std::env::var("TURNSTILE_COMMIT")
        .ok()
        .filter(|commit| !commit.trim().is_empty())
        .or_else(|| {
            // Build again when HEAD moves: HEAD itself (a checkout) and the ref it names (a
            // commit on the branch). `--git-path` resolves both in a linked worktree too.
            for path in ["HEAD", "packed-refs"] {
                if let Some(file) = git(&["rev-parse", "--git-path", path]) {
                    watch(&file);
                }
            }
            if let Some(file) = git(&["symbolic-ref", "-q", "HEAD"])
                .and_then(|reference| git(&["rev-parse", "--git-path", &reference]))
            {
                watch(&file);
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=TURNSTILE_COMMIT={commit}");
}
