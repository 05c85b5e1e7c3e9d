//! Text handling with the exact rules the applier has always used (those of Python 3's text files):
//! files are read with universal newlines (`\r\n` and a lone `\r` become `\n`), lines are split at
//! every Unicode line boundary, and "whitespace" is Unicode whitespace plus `\x1c`..`\x1f`.
//! The generated C file is kept as bytes, so bytes that are not UTF-8 pass through unchanged.

use std::fs;
use std::ops::Range;
use std::path::Path;

use crate::PatchError;

/// Regex class for one whitespace character as Python's `\s` and `str.isspace` see it (Unicode
/// `White_Space`, which is Rust's `\s`, plus the information separators `\x1c`..`\x1f`).
pub(crate) const WS: &str = r"[\s\x1c-\x1f]";
/// The complement of [`WS`] (Python's `\S`).
pub(crate) const NOT_WS: &str = r"[^\s\x1c-\x1f]";

/// `\r\n` and lone `\r` become `\n`.
pub(crate) fn universal_newlines(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\r' {
            out.push(b'\n');
            if bytes.get(i + 1) == Some(&b'\n') {
                i += 1;
            }
        } else {
            out.push(bytes[i]);
        }
        i += 1;
    }
    out
}

/// Reads a text file the way the applier reads `control.h`, `version.mk` and apt sources: invalid
/// UTF-8 replaced, universal newlines.
pub(crate) fn read_text(path: &Path) -> Result<String, PatchError> {
    let bytes = fs::read(path).map_err(|e| PatchError::io(path, e))?;
    Ok(String::from_utf8_lossy(&universal_newlines(&bytes)).into_owned())
}

/// The ranges of the lines of `text`, each with its ending, split where Python's
/// `str.splitlines(keepends=True)` splits the text decoded from these bytes: `\n`, `\r`, `\r\n`,
/// `\v`, `\f`, `\x1c`, `\x1d`, `\x1e`, U+0085, U+2028 and U+2029. (Those multi-byte characters
/// always decode as themselves: their lead bytes can never continue another sequence.)
pub(crate) fn split_lines(text: &[u8]) -> Vec<Range<usize>> {
    let mut lines = Vec::new();
    let (mut start, mut i) = (0, 0);
    while i < text.len() {
        let end = match (text[i], text.get(i + 1), text.get(i + 2)) {
            (b'\r', Some(b'\n'), _) => Some(i + 2),
            (b'\n' | b'\r' | 0x0b | 0x0c | 0x1c..=0x1e, _, _) => Some(i + 1),
            (0xc2, Some(0x85), _) => Some(i + 2),
            (0xe2, Some(0x80), Some(0xa8 | 0xa9)) => Some(i + 3),
            _ => None,
        };
        match end {
            Some(end) => {
                lines.push(start..end);
                start = end;
                i = end;
            }
            None => i += 1,
        }
    }
    if start < text.len() {
        lines.push(start..text.len());
    }
    lines
}

/// `line.rstrip("\r\n")`.
pub(crate) fn rstrip_crlf(line: &[u8]) -> &[u8] {
    let mut end = line.len();
    while end > 0 && matches!(line[end - 1], b'\r' | b'\n') {
        end -= 1;
    }
    &line[..end]
}

/// Python's `str.isspace` for one character.
pub(crate) fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Python's `str.strip()`.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Python's `str.split()` (no argument): runs of whitespace separate, no empty words.
pub(crate) fn py_split(s: &str) -> Vec<&str> {
    s.split(is_py_space).filter(|w| !w.is_empty()).collect()
}

/// Python's `str.splitlines()` (without the endings).
pub(crate) fn py_splitlines(s: &str) -> Vec<&str> {
    split_lines(s.as_bytes())
        .into_iter()
        .map(|r| {
            s[r].trim_end_matches([
                '\n', '\r', '\x0b', '\x0c', '\x1c', '\x1d', '\x1e', '\u{85}', '\u{2028}',
                '\u{2029}',
            ])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[u8]) -> Vec<&[u8]> {
        split_lines(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn splits_like_python_splitlines_keepends() {
        assert!(lines(b"").is_empty());
        assert_eq!(lines(b"a"), [&b"a"[..]]);
        assert_eq!(lines(b"a\n\nb"), [&b"a\n"[..], b"\n", b"b"]);
        assert_eq!(lines(b"a\r\nb\rc\n"), [&b"a\r\n"[..], b"b\r", b"c\n"]);
        assert_eq!(
            lines(b"a\x0bb\x0cc\x1cd\x1fe"),
            [&b"a\x0b"[..], b"b\x0c", b"c\x1c", b"d\x1fe"]
        );
        assert_eq!(
            lines("a\u{85}b\u{2028}c\u{2029}d".as_bytes()),
            [
                "a\u{85}".as_bytes(),
                "b\u{2028}".as_bytes(),
                "c\u{2029}".as_bytes(),
                b"d"
            ]
        );
        // A lone 0x85 byte is not UTF-8 for U+0085: no split.
        assert_eq!(lines(b"a\x85b\xe2\x80\xa7c"), [&b"a\x85b\xe2\x80\xa7c"[..]]);
    }

    #[test]
    fn newlines_strip_and_whitespace() {
        assert_eq!(universal_newlines(b"a\r\nb\rc\n\r"), b"a\nb\nc\n\n");
        assert_eq!(rstrip_crlf(b"x,\r\n\n"), b"x,");
        assert_eq!(rstrip_crlf(b"x,\x0b"), b"x,\x0b");
        assert_eq!(py_strip("\x1c deb x \u{a0}\t"), "deb x");
        assert_eq!(py_split(" a\x1fb  c\u{3000}d "), ["a", "b", "c", "d"]);
        assert_eq!(py_splitlines("a: 1\r\nb\x0bc\u{2028}"), ["a: 1", "b", "c"]);
    }

    #[test]
    fn ws_class_matches_python_whitespace() {
        let ws = regex::Regex::new(&format!("^{WS}+$")).unwrap();
        for c in [
            '\t', '\n', '\x0b', '\x0c', '\r', '\x1c', '\x1d', '\x1e', '\x1f', ' ', '\u{85}',
        ]
        .into_iter()
        .chain([
            '\u{a0}', '\u{1680}', '\u{2000}', '\u{200a}', '\u{2028}', '\u{202f}', '\u{3000}',
        ]) {
            assert!(ws.is_match(&c.to_string()), "{c:?}");
            assert!(is_py_space(c), "{c:?}");
        }
        for c in ['\u{180e}', '\u{200b}', 'x', '\0', '\u{feff}'] {
            assert!(!ws.is_match(&c.to_string()), "{c:?}");
            assert!(!is_py_space(c), "{c:?}");
        }
    }
}
