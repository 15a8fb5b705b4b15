//! The layering check of `cargo xtask lint`: no file of the library's
//! `src/` may depend, through any chain of others, on a file that depends
//! on it.
//!
//! A file depends on another when it names a path into that file's module:
//! `crate::a::b` (also inside a `use crate::{..}` group) or `super::x`.
//! A parent naming its own child module (`self::worker::Job` in
//! `engine/mod.rs`) is how Rust nests modules and is not counted, and a
//! child may use its parent's items (`use super::Engine` in
//! `engine/health.rs`); what fails the check is a cycle of such paths
//! between files, e.g. `error` naming `engine` while `engine` names
//! `error`. Test modules (`tests`, `#[cfg(test)] mod tests`) are
//! left out: tests may look anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module, by its path from the crate root (`["engine", "worker"]`).
type Module = Vec<String>;

/// The groups of files of `src` that depend on each other in a circle,
/// each as the files' module paths; empty when the layering holds.
pub fn cycles(src: &Path) -> Result<Vec<Vec<String>>, String> {
    let sources = read_modules(src)?;
    let known: BTreeSet<Module> = sources.keys().cloned().collect();
    let graph: BTreeMap<Module, BTreeSet<Module>> = sources
        .iter()
        .filter(|(module, _)| !is_test(module))
        .map(|(module, text)| (module.clone(), dependencies(module, text, &known)))
        .collect();
    Ok(strongly_connected(&graph)
        .into_iter()
        .filter(|group| group.len() > 1)
        .map(|group| {
            let mut names: Vec<String> = group.iter().map(display).collect();
            names.sort();
            names
        })
        .collect())
}

fn display(module: &Module) -> String {
    if module.is_empty() {
        "crate".to_string()
    } else {
        module.join("::")
    }
}

fn is_test(module: &Module) -> bool {
    module.iter().any(|part| part == "tests")
}

/// Every `.rs` file under `src`, by the module it defines.
fn read_modules(src: &Path) -> Result<BTreeMap<Module, String>, String> {
    let mut modules = BTreeMap::new();
    let mut pending = vec![src.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                modules.insert(module_of(src, &path), text);
            }
        }
    }
    Ok(modules)
}

/// `src/engine/worker.rs` is `["engine", "worker"]`; `mod.rs` and `lib.rs`
/// are their directory's module.
fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Module = relative
        .components()
        .map(|part| part.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The modules `module`'s text names by `crate::` or `super::` paths,
/// outside its unit tests.
fn dependencies(module: &Module, text: &str, known: &BTreeSet<Module>) -> BTreeSet<Module> {
    let text = without_unit_tests(text);
    let mut found = BTreeSet::new();
    for path in named_paths(text) {
        let (anchor, rest) = path.split_first().expect("a path has an anchor");
        let mut target: Module = match anchor.as_str() {
            "crate" => Vec::new(),
            _ => module[..module.len().saturating_sub(1)].to_vec(),
        };
        target.extend(rest.iter().cloned());
        if let Some(file) = longest_known_prefix(&target, known) {
            if file != *module && !file.is_empty() && !is_test(&file) {
                found.insert(file);
            }
        }
    }
    found
}

/// The text before a `#[cfg(test)] mod tests {` block, which by this
/// crate's convention ends its file.
fn without_unit_tests(text: &str) -> &str {
    let mut search = 0;
    while let Some(at) = text[search..].find("#[cfg(test)]") {
        let start = search + at;
        let after = text[start + "#[cfg(test)]".len()..].trim_start();
        if after.starts_with("mod tests") {
            return &text[..start];
        }
        search = start + 1;
    }
    text
}

/// Every `crate::..` and `super::..` path in `text`, as its segments, with
/// each member of a `use crate::{a, b::c}` group as a path of its own.
fn named_paths(text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    for anchor in ["crate", "super"] {
        let mut search = 0;
        while let Some(at) = text[search..].find(anchor) {
            let start = search + at;
            search = start + anchor.len();
            let preceded_by_word = text[..start]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
            if preceded_by_word || !text[search..].starts_with("::") {
                continue;
            }
            let rest = &text[search + 2..];
            if let Some(group) = rest.strip_prefix('{') {
                for member in group_members(group) {
                    paths.push(std::iter::once(anchor.to_string()).chain(member).collect());
                }
            } else {
                let segments = path_segments(rest);
                if !segments.is_empty() {
                    paths.push(
                        std::iter::once(anchor.to_string())
                            .chain(segments)
                            .collect(),
                    );
                }
            }
        }
    }
    paths
}

/// The first segment of each member of a `{a, b::c, d::{e, f}}` group
/// (enough to find the module each names), up to the group's closing brace.
fn group_members(group: &str) -> Vec<Vec<String>> {
    let mut members = Vec::new();
    let (mut depth, mut at_member_start) = (0usize, true);
    for (index, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_member_start = true,
            c if at_member_start && (c.is_alphanumeric() || c == '_') => {
                at_member_start = false;
                let segments = path_segments(&group[index..]);
                if !segments.is_empty() {
                    members.push(segments);
                }
            }
            _ => {}
        }
    }
    members
}

/// The identifiers of a path like `a::b::C` at the start of `text`.
fn path_segments(text: &str) -> Vec<String> {
    let mut segments = Vec::new();
    let mut rest = text;
    loop {
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        segments.push(rest[..end].to_string());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    segments
}

fn longest_known_prefix(path: &Module, known: &BTreeSet<Module>) -> Option<Module> {
    (0..=path.len())
        .rev()
        .map(|length| path[..length].to_vec())
        .find(|prefix| known.contains(prefix))
}

/// Tarjan's strongly connected components of `graph`.
fn strongly_connected(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Search<'a> {
        graph: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        groups: Vec<Vec<Module>>,
    }
    impl<'a> Search<'a> {
        fn visit(&mut self, node: &'a Module) {
            let order = self.index.len();
            self.index.insert(node, order);
            self.low.insert(node, order);
            self.stack.push(node);
            self.on_stack.insert(node);
            for next in self.graph.get(node).into_iter().flatten() {
                if !self.graph.contains_key(next) {
                    continue;
                }
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut group = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    group.push(member.clone());
                    if member == node {
                        break;
                    }
                }
                self.groups.push(group);
            }
        }
    }
    let mut search = Search {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        groups: Vec::new(),
    };
    for node in graph.keys() {
        if !search.index.contains_key(node) {
            search.visit(node);
        }
    }
    search.groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_with(files: &[(&str, &str)]) -> tempdir::Dir {
        let dir = tempdir::Dir::new();
        for (name, text) in files {
            let path = dir.0.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    /// A scratch directory removed when dropped.
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);

        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicUsize, Ordering};
                static NEXT: AtomicUsize = AtomicUsize::new(0);
                let path = std::env::temp_dir().join(format!(
                    "xtask-layers-{}-{}",
                    std::process::id(),
                    NEXT.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&path).unwrap();
                Dir(path)
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn layers_that_only_look_down_have_no_cycle() {
        let src = crate_with(&[
            ("lib.rs", "mod engine; mod error; pub use engine::Engine;"),
            ("error.rs", "pub struct Error;"),
            (
                "engine/mod.rs",
                "mod worker; use crate::error::Error; use worker::Job;",
            ),
            ("engine/worker.rs", "use crate::{error::Error};"),
        ]);
        assert_eq!(cycles(&src.0).unwrap(), Vec::<Vec<String>>::new());
    }

    #[test]
    fn modules_naming_each_other_are_a_cycle() {
        let src = crate_with(&[
            ("lib.rs", "mod engine; mod error;"),
            ("error.rs", "use crate::engine::Engine;"),
            (
                "engine/mod.rs",
                "mod worker; use crate::{error::Error, other};",
            ),
            ("engine/worker.rs", "use super::Engine;"),
        ]);
        assert_eq!(
            cycles(&src.0).unwrap(),
            vec![vec!["engine".to_string(), "error".to_string()]]
        );
    }

    #[test]
    fn unit_tests_and_test_modules_are_left_out() {
        let src = crate_with(&[
            ("lib.rs", "mod a; mod b; mod tests;"),
            (
                "a.rs",
                "fn f() {}\n#[cfg(test)]\nmod tests { use crate::b::B; }",
            ),
            ("b.rs", "use crate::a::f;"),
            ("tests.rs", "use crate::a::f; use crate::b::B;"),
        ]);
        assert!(cycles(&src.0).unwrap().is_empty());
        std::fs::write(src.0.join("a.rs"), "use crate::b::B;").unwrap();
        assert_eq!(
            cycles(&src.0).unwrap(),
            vec![vec!["a".to_string(), "b".to_string()]]
        );
    }

    #[test]
    fn the_library_has_no_cycle() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../src");
        assert_eq!(cycles(&src).unwrap(), Vec::<Vec<String>>::new());
    }
}
