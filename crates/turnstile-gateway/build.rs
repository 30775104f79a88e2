//! Names the commit the binary was built from, for `turnstile_build_info{commit}`:
//! `TURNSTILE_BUILD_COMMIT` when set (a packager building outside git), else `git rev-parse`,
//! else `unknown`. Re-run when HEAD moves, so the label is never a stale commit.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    Some(text.trim().to_owned()).filter(|text| !text.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=TURNSTILE_BUILD_COMMIT");
    let commit = match std::env::var("TURNSTILE_BUILD_COMMIT") {
        Ok(commit) if !commit.is_empty() => commit,
        _ => {
            // HEAD of this worktree and the branch file it names (loose or packed).
            if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
                println!("cargo:rerun-if-changed={head}");
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(reference) = git(&["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={reference}");
            }
            if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
                println!("cargo:rerun-if-changed={packed}");
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
    };
    println!("cargo:rustc-env=TURNSTILE_BUILD_COMMIT={commit}");
}
