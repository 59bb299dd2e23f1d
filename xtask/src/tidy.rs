//! `cargo xtask tidy`: house rules that no compiler lint covers.
//!
//! Each rule is a function that appends violations, each naming the file and what to do. The
//! rules, and why:
//! - every Rust file opens with a `//!` line: a reader learns what a file is for before its code;
//! - every ignored test says why (`#[ignore = "reason"]`): a bare ignore hides a test forever;
//! - every package inherits the workspace lints, so the unsafe contract holds everywhere;
//! - every crate root either forbids/denies `unsafe_code` or has a `//! # Unsafe` section that
//!   says where unsafe lives and why (STYLE.md, "Unsafe");
//! - every crate has a README.md, for the people who cherry-pick one crate;
//! - every committed fixture is named in `fixtures/README.md` with the command that made it;
//! - CHANGELOG.md keeps an `## [Unreleased]` section in Keep-a-Changelog form.

use std::fmt;
use std::path::{Path, PathBuf};

/// The rule violations found, one line each.
#[derive(Debug)]
pub(crate) struct Violations(Vec<String>);

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tidy found {} problem(s):", self.0.len())?;
        for v in &self.0 {
            writeln!(f, "  {v}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Violations {}

/// Checks every rule over the workspace at `root`.
pub(crate) fn run(root: &Path) -> Result<(), Violations> {
    let mut found = Vec::new();
    let rust_files = rust_files(root);
    for file in &rust_files {
        let Ok(text) = std::fs::read_to_string(file) else {
            found.push(format!("{}: not readable as UTF-8", rel(root, file)));
            continue;
        };
        check_module_doc(root, file, &text, &mut found);
        check_ignore_reasons(root, file, &text, &mut found);
    }
    check_packages(root, &mut found);
    check_fixtures(root, &mut found);
    check_changelog(root, &mut found);
    if found.is_empty() {
        Ok(())
    } else {
        Err(Violations(found))
    }
}

fn rel(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Every `.rs` file of the workspace's packages, skipping build output.
fn rust_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["crates", "xtask", "benches"] {
        walk(&root.join(dir), &mut |p| {
            if p.extension().is_some_and(|e| e == "rs") {
                out.push(p.to_owned());
            }
        });
    }
    out.sort();
    out
}

fn walk(dir: &Path, visit: &mut dyn FnMut(&Path)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "target" || name.starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(&path, visit);
        } else {
            visit(&path);
        }
    }
}

fn check_module_doc(root: &Path, file: &Path, text: &str, found: &mut Vec<String>) {
    if !text.starts_with("//!") {
        found.push(format!(
            "{}: must open with a `//!` line saying what the file is for",
            rel(root, file)
        ));
    }
}

fn check_ignore_reasons(root: &Path, file: &Path, text: &str, found: &mut Vec<String>) {
    // Spelled in two halves so this file does not trip its own rule.
    let bare = concat!("#[", "ignore]");
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with(bare) {
            found.push(format!(
                "{}:{}: `{bare}` without a reason; write `#[ignore = \"why\"]`",
                rel(root, file),
                i + 1
            ));
        }
    }
}

fn check_packages(root: &Path, found: &mut Vec<String>) {
    let mut manifests = vec![
        root.join("xtask/Cargo.toml"),
        root.join("benches/Cargo.toml"),
    ];
    let mut crate_dirs = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("crates")) {
        for e in entries.filter_map(Result::ok) {
            if e.path().join("Cargo.toml").exists() {
                crate_dirs.push(e.path());
            }
        }
    }
    crate_dirs.sort();
    manifests.extend(crate_dirs.iter().map(|d| d.join("Cargo.toml")));
    for manifest in &manifests {
        let text = std::fs::read_to_string(manifest).unwrap_or_default();
        let inherits = text
            .split("[lints]")
            .nth(1)
            .is_some_and(|rest| rest.trim_start().starts_with("workspace = true"));
        if !inherits {
            found.push(format!(
                "{}: add `[lints]\\nworkspace = true` so the workspace's unsafe contract applies",
                rel(root, manifest)
            ));
        }
    }
    for dir in &crate_dirs {
        if !dir.join("README.md").exists() {
            found.push(format!(
                "{}: missing README.md for people who use this crate alone",
                rel(root, dir)
            ));
        }
        let lib = dir.join("src/lib.rs");
        let Ok(text) = std::fs::read_to_string(&lib) else {
            continue;
        };
        let safe_root =
            text.contains("#![forbid(unsafe_code)]") || text.contains("#![deny(unsafe_code)]");
        let explains_unsafe = text.lines().any(|l| l.trim() == "//! # Unsafe");
        if !safe_root && !explains_unsafe {
            found.push(format!(
                "{}: either `#![deny(unsafe_code)]` or a `//! # Unsafe` section saying where unsafe \
                 lives and why",
                rel(root, &lib)
            ));
        }
    }
}

fn check_fixtures(root: &Path, found: &mut Vec<String>) {
    let dir = root.join("fixtures");
    let index = std::fs::read_to_string(dir.join("README.md")).unwrap_or_default();
    if index.is_empty() {
        found.push(
            "fixtures/README.md: missing; it names each fixture and the command that made it"
                .into(),
        );
        return;
    }
    walk(&dir, &mut |path| {
        let name = rel(&dir, path);
        if name == "README.md" {
            return;
        }
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if !index.contains(&name) && !index.contains(file_name) {
            found.push(format!(
                "fixtures/{name}: not named in fixtures/README.md; add it with the command that made it"
            ));
        }
    });
}

fn check_changelog(root: &Path, found: &mut Vec<String>) {
    let text = std::fs::read_to_string(root.join("CHANGELOG.md")).unwrap_or_default();
    if !text.contains("## [Unreleased]") {
        found.push("CHANGELOG.md: keep an `## [Unreleased]` section (Keep a Changelog)".into());
    }
}
