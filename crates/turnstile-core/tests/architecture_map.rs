//! The docs a newcomer reads stay true to the tree: ARCHITECTURE.md's code map names every
//! source file of every crate (and no file that is gone), and every relative link in README.md,
//! ARCHITECTURE.md and `docs/` leads to a file that exists.
//!
//! Pure std, no dependency: the repository root is two levels above this crate's manifest.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn repository_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .parent()
        .and_then(Path::parent)
        .expect("crates/<name> sits two levels below the root");
    assert!(
        root.join("ARCHITECTURE.md").is_file(),
        "no ARCHITECTURE.md at {}",
        root.display()
    );
    root.to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

/// Every `.rs` file under `dir`, as a path relative to `base` with `/` separators.
fn rust_files(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(base, &path, out);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            let relative = path.strip_prefix(base).expect("under its base");
            let parts: Vec<_> = relative
                .components()
                .map(|part| part.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.insert(parts.join("/"));
        }
    }
}

/// The source files of the tree: `crates/<crate>/src/<path>.rs` as (crate, path).
fn source_files(root: &Path) -> BTreeSet<(String, String)> {
    let mut files = BTreeSet::new();
    let mut crates: Vec<_> = fs::read_dir(root.join("crates"))
        .expect("a crates directory")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.join("src").is_dir())
        .collect();
    crates.sort();
    for krate in crates {
        let name = krate
            .file_name()
            .expect("a crate directory name")
            .to_string_lossy()
            .into_owned();
        let mut paths = BTreeSet::new();
        rust_files(&krate.join("src"), &krate.join("src"), &mut paths);
        files.extend(paths.into_iter().map(|path| (name.clone(), path)));
    }
    files
}

/// The entries of the code map: under each `### \`crates/<crate>\`` heading of `## Code map`,
/// the first code span of each list item (`- \`serve/api.rs\` — …`), as (crate, path).
fn code_map_entries(architecture: &str) -> BTreeSet<(String, String)> {
    let mut entries = BTreeSet::new();
    let mut in_map = false;
    let mut krate: Option<String> = None;
    for line in architecture.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            in_map = heading.trim() == "Code map";
            krate = None;
            continue;
        }
        if !in_map {
            continue;
        }
        if let Some(heading) = line.strip_prefix("### ") {
            krate = heading
                .split('`')
                .nth(1)
                .and_then(|span| span.strip_prefix("crates/"))
                .map(|name| name.trim_end_matches('/').to_owned());
            continue;
        }
        let (Some(name), Some(item)) = (&krate, line.strip_prefix("- `")) else {
            continue;
        };
        if let Some((path, _)) = item.split_once('`') {
            entries.insert((name.clone(), path.to_owned()));
        }
    }
    entries
}

/// What the map lacks (files of the tree it does not name) and what it names that is not a
/// file of the tree, each as `crates/<crate>/src/<path>`.
fn differences(
    files: &BTreeSet<(String, String)>,
    entries: &BTreeSet<(String, String)>,
) -> (Vec<String>, Vec<String>) {
    let show = |(krate, path): &(String, String)| format!("crates/{krate}/src/{path}");
    (
        files.difference(entries).map(show).collect(),
        entries.difference(files).map(show).collect(),
    )
}

#[test]
fn the_code_map_names_every_source_file_and_only_those() {
    let root = repository_root();
    let files = source_files(&root);
    assert!(
        files.len() > 100,
        "found only {} source files: the walk is wrong",
        files.len()
    );
    let entries = code_map_entries(&read(&root.join("ARCHITECTURE.md")));
    let (missing, stale) = differences(&files, &entries);
    assert!(
        missing.is_empty() && stale.is_empty(),
        "ARCHITECTURE.md's code map does not match the tree.\n\
         Files it does not name (add a line `- \\`path\\` — what it owns` under the crate's heading):\n  {}\n\
         Entries that are no file of the tree:\n  {}",
        missing.join("\n  "),
        stale.join("\n  "),
    );
}

#[test]
fn the_comparison_names_a_file_left_out_of_the_map_and_an_entry_left_behind() {
    let files: BTreeSet<_> = [("turnstile-core", "lib.rs"), ("turnstile-core", "parse.rs")]
        .into_iter()
        .map(|(krate, path)| (krate.to_owned(), path.to_owned()))
        .collect();
    let map = "## Code map\n\n### `crates/turnstile-core` — rules\n\n- `lib.rs` — the root.\n\
               - `gone.rs` — removed since.\n  `parse.rs` in a continuation line is no entry.\n\n\
               ## Glossary\n\n- `parse.rs` — outside the map.\n";
    let (missing, stale) = differences(&files, &code_map_entries(map));
    assert_eq!(missing, ["crates/turnstile-core/src/parse.rs"]);
    assert_eq!(stale, ["crates/turnstile-core/src/gone.rs"]);
}

/// The targets of the inline links and images of a markdown text (`[text](target)`), outside
/// fenced code blocks and code spans.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Text outside code spans: every other piece between backticks.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            if let Some(end) = rest.find(')') {
                targets.push(rest[..end].trim().to_owned());
                rest = &rest[end + 1..];
            }
        }
    }
    targets
}

/// The relative links of `file` that lead nowhere, as `file: target`.
fn broken_links(root: &Path, file: &Path) -> Vec<String> {
    let directory = file.parent().expect("a file in a directory");
    let mut broken = Vec::new();
    for target in link_targets(&read(file)) {
        let path = target.split('#').next().unwrap_or_default();
        let external = ["http://", "https://", "mailto:"]
            .iter()
            .any(|scheme| target.starts_with(scheme));
        if external || path.is_empty() {
            continue;
        }
        if !directory.join(path).exists() {
            let shown = file.strip_prefix(root).unwrap_or(file);
            broken.push(format!("{}: {target}", shown.display()));
        }
    }
    broken
}

fn markdown_files(directory: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("cannot list {}: {error}", directory.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "md"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_relative_link_in_the_readme_architecture_and_docs_leads_to_a_file() {
    let root = repository_root();
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    files.extend(markdown_files(&root.join("docs")));
    files.extend(markdown_files(&root.join("docs/decisions")));
    assert!(
        files.len() > 100,
        "found only {} markdown files: the walk is wrong",
        files.len()
    );
    let broken: Vec<_> = files.iter().flat_map(|file| broken_links(&root, file)).collect();
    assert!(
        broken.is_empty(),
        "relative links that lead to no file:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn the_link_reader_skips_code_and_finds_links_and_images() {
    let text = "See [a](a.md#part) and ![b](img/b.svg), [web](https://example.com).\n\
                `[not](a link)` here.\n```\n[not](in a block)\n```\n[c](../c.md)";
    assert_eq!(
        link_targets(text),
        ["a.md#part", "img/b.svg", "https://example.com", "../c.md"]
    );
}
