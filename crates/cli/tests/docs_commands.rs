//! Every `tokenpath` command the README and `docs/` show names a command that exists and only
//! flags that command has, and every `scripts/...` they name is there: the user's guide cannot
//! drift from the binary. The flags come from the binary's own `--help`, the commands from the
//! markdown (code blocks and inline code).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenpath")).args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "tokenpath {args:?} --help failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The long flags a help text lists.
fn flags(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for word in text.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']') {
        if let Some(rest) = word.strip_prefix("--") {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// The subcommands `tokenpath --help` lists, each with its flags.
fn commands() -> BTreeMap<String, BTreeSet<String>> {
    let top = help(&[]);
    let list = top.split("Commands:").nth(1).unwrap().split("Options:").next().unwrap();
    let mut out = BTreeMap::new();
    for line in list.lines() {
        let Some(name) = line.split_whitespace().next() else { continue };
        if name == "help" {
            continue;
        }
        let mut f = flags(&help(&[name]));
        f.extend(flags(&top));
        out.insert(name.to_owned(), f);
    }
    out
}

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Every stretch of code in a markdown text: fenced blocks line by line, and inline spans.
fn code(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            out.push(line.to_owned());
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let Some(inline) = parts.next() {
            out.push(inline.replace("\\|", "|"));
            parts.next();
        }
    }
    out
}

#[test]
fn every_command_in_the_readme_and_docs_exists_with_the_flags_it_shows() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let commands = commands();
    assert!(commands.contains_key("serve") && commands["serve"].contains("kv-pool-ram"), "{commands:?}");
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        for snippet in code(&text) {
            // Each command of a snippet (a pipeline or `;`/`&&` list may hold several).
            // A shell comment is not part of the command.
            let snippet = snippet.split(" #").next().unwrap_or_default();
            for part in snippet.split(['|', ';']).flat_map(|p| p.split("&&")) {
                let words: Vec<&str> = part.split_whitespace().collect();
                if let Some(i) = words.iter().position(|w| w.ends_with("scripts/") || w.contains("scripts/"))
                {
                    let script = words[i].trim_start_matches("./").trim_matches(|c| c == '(' || c == ')');
                    // `scripts/x` at the root, or a crate's own (`crates/engine/scripts/x`).
                    if let Some((dir, rel)) = script.split_once("scripts/").filter(|(_, r)| !r.is_empty()) {
                        let rel = rel.trim_end_matches([',', '.', ':']);
                        let plain = format!("{dir}{rel}").chars().all(|c| {
                            c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '/' || c == '.'
                        });
                        let path = root.join(dir).join("scripts").join(rel);
                        if plain && !rel.contains('*') && !path.exists() {
                            problems.push(format!(
                                "{name}: {dir}scripts/{rel} does not exist (`{}`)",
                                part.trim()
                            ));
                        }
                    }
                }
                let Some(at) = words.iter().position(|w| w.ends_with("tokenpath")) else { continue };
                let Some(sub) = words.get(at + 1) else { continue };
                if sub.starts_with('-') || sub.starts_with('<') || sub.starts_with('[') {
                    continue;
                }
                let Some(known) = commands.get(*sub) else {
                    if sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') && sub.len() > 2 {
                        problems
                            .push(format!("{name}: `tokenpath {sub}` is not a command (`{}`)", part.trim()));
                    }
                    continue;
                };
                checked += 1;
                for w in &words[at + 2..] {
                    for flag in flags(w) {
                        if !known.contains(&flag) {
                            problems.push(format!(
                                "{name}: `tokenpath {sub}` has no --{flag} (`{}`)",
                                part.trim()
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} commands found: is the extraction broken?");
    eprintln!("{checked} tokenpath commands checked");
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
}
