//! No top-level module of a crate imports one that imports it back: the
//! layering docs/layout.md describes (fail points a leaf, scenarios and
//! the scheduler apart, error types imported by their subsystems and not the
//! other way) holds for every crate of the workspace, and a change that
//! closes a loop fails here with the two modules and a line of each side.
//!
//! A module is a `src/` folder or file (`node/`, `kv_pool.rs`); an import is
//! any `crate::name` path in code (comments are skipped), in a `use` or
//! written inline.
//!
//! The same holds inside every folder: no two files of one folder
//! (`rdma/handshake.rs`, `rdma/verbs.rs`) import each other, by
//! `super::name` or by their whole `crate::` path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The crates' source folders, from the workspace root.
const CRATES: &[&str] = &[
    "src",
    "engine/src",
    "sanitizer/src",
    "kernels/src",
    "shim/src",
    "audit/src",
];

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`None` for the crate root).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("below src");
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_string())
}

/// The modules named by `crate::name` in `line` (code only).
fn imports(line: &str) -> Vec<String> {
    let code = line.trim_start();
    if code.starts_with("//") {
        return Vec::new();
    }
    let code = code.split("//").next().unwrap_or(code);
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        // `$crate::` and `kvsan_crate::` are not this crate's paths.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !name.is_empty() {
            found.push(name);
        }
    }
    found
}

/// For each (module, imported module): one `file:line` where it happens.
fn edges(src: &Path) -> BTreeMap<(String, String), String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges = BTreeMap::new();
    for file in files {
        let Some(from) = module_of(src, &file) else {
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("source file");
        for (n, line) in text.lines().enumerate() {
            for to in imports(line) {
                if to != from {
                    edges
                        .entry((from.clone(), to))
                        .or_insert_with(|| format!("{}:{}", file.display(), n + 1));
                }
            }
        }
    }
    edges
}

/// The loops among `src`'s modules, each with a line of both sides.
fn loops(src: &Path) -> Vec<String> {
    let edges = edges(src);
    let mut loops = Vec::new();
    for ((a, b), at) in &edges {
        if a < b
            && let Some(back) = edges.get(&(b.clone(), a.clone()))
        {
            loops.push(format!("{a} <-> {b} ({at} / {back})"));
        }
    }
    loops
}

/// The sibling modules `line` of a file names: `super::name`, or
/// `crate::<folder path>::name`, for a `name` of `siblings` (code only).
fn sibling_imports(line: &str, folder_path: &str, siblings: &[String]) -> Vec<String> {
    let code = line.trim_start();
    if code.starts_with("//") {
        return Vec::new();
    }
    let code = code.split("//").next().unwrap_or(code);
    let mut prefixes = vec!["super::".to_string()];
    if !folder_path.is_empty() {
        prefixes.push(format!("crate::{folder_path}::"));
    }
    let mut found = Vec::new();
    for prefix in &prefixes {
        let mut rest = code;
        while let Some(at) = rest.find(prefix.as_str()) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$' || c == ':') {
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            // `super::{a, b}` names each of them.
            if name.is_empty() && rest.starts_with('{') {
                let group = rest[1..].split('}').next().unwrap_or_default();
                for item in group.split(',') {
                    let item = item.trim().split("::").next().unwrap_or_default();
                    if siblings.iter().any(|s| s == item) {
                        found.push(item.to_string());
                    }
                }
            } else if siblings.contains(&name) {
                found.push(name);
            }
        }
    }
    found
}

/// For each folder below `src`: (file, sibling it imports) → one `file:line`,
/// the names as `folder/file`.
fn sibling_edges(src: &Path) -> BTreeMap<(String, String), String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges = BTreeMap::new();
    for file in &files {
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if matches!(stem, "mod" | "lib" | "main") {
            continue;
        }
        let dir = file.parent().expect("a file has a folder");
        let folder = dir.strip_prefix(src).expect("below src");
        let folder_path: Vec<&str> = folder.iter().filter_map(|c| c.to_str()).collect();
        let siblings: Vec<String> = std::fs::read_dir(dir)
            .expect("the file's folder")
            .filter_map(|e| {
                let path = e.ok()?.path();
                let name = path.file_stem()?.to_str()?.to_string();
                let module = path.is_dir() || path.extension().is_some_and(|x| x == "rs");
                (module && name != stem && !matches!(name.as_str(), "mod" | "lib" | "main"))
                    .then_some(name)
            })
            .collect();
        let text = std::fs::read_to_string(file).expect("source file");
        let at = |name: &str| format!("{}/{name}", folder.display());
        for (n, line) in text.lines().enumerate() {
            for to in sibling_imports(line, &folder_path.join("::"), &siblings) {
                edges
                    .entry((at(stem), at(&to)))
                    .or_insert_with(|| format!("{}:{}", file.display(), n + 1));
            }
        }
    }
    edges
}

/// The loops between two files of one folder, each with a line of both sides.
fn sibling_loops(src: &Path) -> Vec<String> {
    let edges = sibling_edges(src);
    let mut loops = Vec::new();
    for ((a, b), at) in &edges {
        if a < b
            && let Some(back) = edges.get(&(b.clone(), a.clone()))
        {
            loops.push(format!("{a} <-> {b} ({at} / {back})"));
        }
    }
    loops
}

#[test]
fn no_file_imports_a_sibling_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The scanner reads the sources: files of the engine import siblings.
    assert!(sibling_edges(&root.join("engine/src")).len() > 20);
    let found: Vec<String> = CRATES
        .iter()
        .flat_map(|krate| sibling_loops(&root.join(krate)))
        .collect();
    assert!(
        found.is_empty(),
        "import loops inside folders:\n{}",
        found.join("\n")
    );
}

#[test]
fn two_files_of_a_folder_that_import_each_other_are_a_loop() {
    let dir = std::env::temp_dir().join(format!("kvsan-sibling-loops-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("net")).expect("temp dir");
    std::fs::write(dir.join("lib.rs"), "pub mod net;\n").expect("write");
    std::fs::write(dir.join("net/mod.rs"), "mod verbs;\nmod handshake;\n").expect("write");
    std::fs::write(
        dir.join("net/handshake.rs"),
        "use super::{verbs::Qp, Error};\n",
    )
    .expect("write");
    std::fs::write(
        dir.join("net/verbs.rs"),
        "// super::handshake in a comment\n",
    )
    .expect("write");
    assert!(sibling_loops(&dir).is_empty(), "one way is no loop");
    std::fs::write(
        dir.join("net/verbs.rs"),
        "fn f() { crate::net::handshake::g() }\n",
    )
    .expect("write");
    let found = sibling_loops(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("net/handshake <-> net/verbs"),
        "{found:?}"
    );
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The scanner reads the sources: the engine's modules import each other.
    assert!(edges(&root.join("engine/src")).len() > 20);
    let found: Vec<String> = CRATES
        .iter()
        .flat_map(|krate| loops(&root.join(krate)))
        .collect();
    assert!(found.is_empty(), "import loops:\n{}", found.join("\n"));
}

#[test]
fn a_folder_and_a_file_that_import_each_other_are_a_loop() {
    let dir = std::env::temp_dir().join(format!("kvsan-loops-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("node")).expect("temp dir");
    std::fs::write(dir.join("lib.rs"), "pub mod node;\npub mod faults;\n").expect("write");
    std::fs::write(dir.join("node/mod.rs"), "mod step;\n").expect("write");
    std::fs::write(dir.join("node/step.rs"), "use crate::faults::Fault;\n").expect("write");
    std::fs::write(dir.join("faults.rs"), "// crate::node in a comment\n").expect("write");
    assert!(loops(&dir).is_empty(), "one way is no loop");
    std::fs::write(dir.join("faults.rs"), "fn f() { crate::node::step::g() }\n").expect("write");
    let found = loops(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("faults <-> node"), "{found:?}");
}

#[test]
fn a_loop_is_seen() {
    // The scanner itself: both directions of a loop are found, comments
    // and other crates' paths are not.
    assert_eq!(imports("use crate::node::lifecycle::State;"), ["node"]);
    assert_eq!(
        imports("    let x = crate::faults::active(crate::faults::Fault::A);"),
        ["faults", "faults"]
    );
    assert!(imports("//! see [`crate::node`]").is_empty());
    assert!(imports("$crate::for_each_hook! { x }").is_empty());
    assert!(imports("use kvsan_crate::x;").is_empty());
    assert_eq!(
        imports("f(); // crate::x in a comment"),
        Vec::<String>::new()
    );
}
