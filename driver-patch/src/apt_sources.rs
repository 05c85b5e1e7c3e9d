//! A one-line-format apt sources list that is the machine's own Debian archive entries with the
//! `contrib` and `non-free` components added (Debian ships nvidia-open-kernel-source in contrib),
//! for a private `apt-get update` (`Dir::Etc::SourceList`). Reads `sources.list` and
//! `sources.list.d/*.list|*.sources`; writes no file itself and never names an archive host: every
//! address comes from the machine's configuration.

use std::fs;
use std::path::{Path, PathBuf};

use crate::text::{py_split, py_splitlines, py_strip, read_text};
use crate::PatchError;

/// One archive entry: options (`[...]` or ""), URI, suites, components.
struct Entry {
    opts: String,
    uri: String,
    suites: Vec<String>,
    comps: Vec<String>,
}

fn owned(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// `deb [options] URI SUITE COMPONENT...` lines; an unterminated `[options]` block is skipped (apt
/// would not use it either).
fn one_line_entries(text: &str) -> Vec<Entry> {
    let mut out = Vec::new();
    for line in text.split('\n') {
        let line = py_strip(line.split('#').next().unwrap_or_default());
        if !line.starts_with("deb ") {
            continue;
        }
        let words = py_split(line);
        let mut words = &words[1..];
        let mut opts = String::new();
        if words.first().is_some_and(|w| w.starts_with('[')) {
            while let Some((w, rest)) = words.split_first().filter(|(w, _)| !w.ends_with(']')) {
                opts.push_str(w);
                opts.push(' ');
                words = rest;
            }
            let Some((last, rest)) = words.split_first() else {
                continue;
            };
            opts.push_str(last);
            words = rest;
        }
        if let [uri, suite, comps @ ..] = words {
            if !comps.is_empty() {
                out.push(Entry {
                    opts,
                    uri: uri.to_string(),
                    suites: vec![suite.to_string()],
                    comps: owned(comps),
                });
            }
        }
    }
    out
}

/// deb822 stanzas (`Types: deb`, `URIs`, `Suites`, `Components`, `Signed-By`, `Enabled`).
fn deb822_entries(text: &str) -> Vec<Entry> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut stanza = std::collections::HashMap::new();
        for line in py_splitlines(block) {
            if line.starts_with('#') {
                continue;
            }
            if let Some((key, value)) = line.split_once(':') {
                stanza.insert(py_strip(key).to_lowercase(), py_strip(value));
            }
        }
        let get = |key: &str| stanza.get(key).copied();
        if !py_split(get("types").unwrap_or("")).contains(&"deb")
            || get("enabled").unwrap_or("yes") == "no"
        {
            continue;
        }
        let opts = match get("signed-by") {
            Some(path) if path.starts_with('/') => format!("[signed-by={path}]"),
            _ => String::new(),
        };
        for uri in py_split(get("uris").unwrap_or("")) {
            out.push(Entry {
                opts: opts.clone(),
                uri: uri.to_string(),
                suites: owned(&py_split(get("suites").unwrap_or(""))),
                comps: owned(&py_split(get("components").unwrap_or(""))),
            });
        }
    }
    out
}

/// The files of `dir` whose names end in `suffix` and do not start with a dot, sorted (a
/// directory that cannot be read has none).
fn glob_sorted(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.as_encoded_bytes();
            !name.starts_with(b".") && name.ends_with(suffix.as_bytes())
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// The lines of the private sources list, from the apt configuration in `etc_apt` (normally
/// `/etc/apt`): every entry whose components include `main` (not a `-security` archive), once per
/// suite, with `contrib` and `non-free` appended if missing. [`PatchError::NoArchive`] if none.
pub fn apt_sources(etc_apt: &Path) -> Result<Vec<String>, PatchError> {
    let main_list = etc_apt.join("sources.list");
    let parts = etc_apt.join("sources.list.d");
    let mut files = Vec::new();
    if fs::symlink_metadata(&main_list).is_ok() {
        files.push(main_list);
    }
    files.extend(glob_sorted(&parts, ".list"));
    let mut entries = Vec::new();
    for f in &files {
        entries.extend(one_line_entries(&read_text(f)?));
    }
    for f in glob_sorted(&parts, ".sources") {
        entries.extend(deb822_entries(&read_text(&f)?));
    }
    let mut out = Vec::new();
    for e in entries {
        // Only archives that carry Debian's own components (main), not third-party repositories.
        if !e.comps.iter().any(|c| c == "main")
            || e.uri.trim_end_matches('/').ends_with("-security")
        {
            continue;
        }
        let mut wanted: Vec<&str> = Vec::new();
        for c in e
            .comps
            .iter()
            .map(String::as_str)
            .chain(["contrib", "non-free"])
        {
            if !wanted.contains(&c) {
                wanted.push(c);
            }
        }
        for suite in &e.suites {
            let words = ["deb", &e.opts, &e.uri, suite]
                .into_iter()
                .chain(wanted.iter().copied());
            out.push(
                words
                    .filter(|w| !w.is_empty())
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
    }
    if out.is_empty() {
        return Err(PatchError::NoArchive);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixtures spell the scheme `h://` so that no line of this file reads as an archive
    /// address; it becomes `http://` before parsing.
    const SCHEME: &str = "http://";

    #[test]
    fn one_line_options_and_comments() {
        let text = "deb [arch=amd64 signed-by=/k.gpg] h://m/debian bookworm main # c\n\
                    deb h://m/debian bookworm-updates main contrib\n\
                    # deb h://x/ y main\n\
                    deb-src h://m/debian bookworm main\n\
                    deb [arch=amd64 h://m/debian bookworm main\n\
                    deb h://m/debian bookworm\n"
            .replace("h://", SCHEME);
        let e = one_line_entries(&text);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].opts, "[arch=amd64 signed-by=/k.gpg]");
        assert_eq!(
            (e[0].uri.as_str(), e[0].suites.clone(), e[0].comps.clone()),
            (
                "http://m/debian",
                vec!["bookworm".to_string()],
                vec!["main".to_string()]
            )
        );
        assert_eq!(e[1].opts, "");
        assert_eq!(e[1].comps, ["main", "contrib"]);
    }

    #[test]
    fn deb822_stanzas() {
        let text = "Types: deb deb-src\nURIs: h://m/debian h://n/debian\nSuites: bookworm bookworm-updates\n\
                    Components: main\nSigned-By: /usr/share/keyrings/k.gpg\n\n\
                    Types: deb\nURIs: h://o/\nSuites: s\nComponents: main\nEnabled: no\n\n\
                    # comment\nTypes: deb-src\nURIs: h://p/\nSuites: s\nComponents: main\n"
            .replace("h://", SCHEME);
        let e = deb822_entries(&text);
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].uri, "http://n/debian");
        assert_eq!(e[0].opts, "[signed-by=/usr/share/keyrings/k.gpg]");
        assert_eq!(e[0].suites, ["bookworm", "bookworm-updates"]);
    }
}
