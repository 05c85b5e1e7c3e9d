//! A port of the parts of Python's `difflib` the applier's emitted patch comes from:
//! `SequenceMatcher` (no junk function, `autojunk=True`) and `unified_diff` with `lineterm="\n"`.
//! The port keeps every rule (the popular-element heuristic, the tie-breaks, the queue order and the
//! hunk grouping) so the emitted text, and therefore its sha256 in `releases.tsv`, are identical to
//! what the Python applier produced. Lines are compared as bytes, with their endings.

use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    Equal,
    Replace,
    Delete,
    Insert,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Opcode {
    tag: Tag,
    i1: usize,
    i2: usize,
    j1: usize,
    j2: usize,
}

struct SequenceMatcher<'s> {
    a: &'s [&'s [u8]],
    b: &'s [&'s [u8]],
    /// For each line of `b` that is not "popular", the indexes where it occurs, ascending.
    b2j: HashMap<&'s [u8], Vec<usize>>,
}

impl<'s> SequenceMatcher<'s> {
    fn new(a: &'s [&'s [u8]], b: &'s [&'s [u8]]) -> Self {
        let mut b2j: HashMap<&[u8], Vec<usize>> = HashMap::new();
        for (i, line) in b.iter().enumerate() {
            b2j.entry(line).or_default().push(i);
        }
        // autojunk: in a sequence of 200 or more, elements more frequent than 1% + 1 are ignored
        // when looking for matches (but matches still extend over them).
        if b.len() >= 200 {
            let ntest = b.len() / 100 + 1;
            b2j.retain(|_, idxs| idxs.len() <= ntest);
        }
        Self { a, b, b2j }
    }

    /// Longest matching block in `a[alo..ahi]` and `b[blo..bhi]`: `(i, j, size)`; among the
    /// longest, the one that starts earliest in `a`, then earliest in `b`.
    fn find_longest_match(
        &self,
        alo: usize,
        ahi: usize,
        blo: usize,
        bhi: usize,
    ) -> (usize, usize, usize) {
        let (a, b) = (self.a, self.b);
        let (mut besti, mut bestj, mut bestsize) = (alo, blo, 0);
        let mut j2len: HashMap<usize, usize> = HashMap::new();
        for (i, line) in a.iter().enumerate().take(ahi).skip(alo) {
            let mut newj2len = HashMap::new();
            for &j in self.b2j.get(line).map(Vec::as_slice).unwrap_or_default() {
                if j < blo {
                    continue;
                }
                if j >= bhi {
                    break;
                }
                let k = j
                    .checked_sub(1)
                    .and_then(|p| j2len.get(&p))
                    .copied()
                    .unwrap_or(0)
                    + 1;
                newj2len.insert(j, k);
                if k > bestsize {
                    (besti, bestj, bestsize) = (i + 1 - k, j + 1 - k, k);
                }
            }
            j2len = newj2len;
        }
        // Extend over equal elements on both sides (popular ones included: there is no junk).
        while besti > alo && bestj > blo && a[besti - 1] == b[bestj - 1] {
            (besti, bestj, bestsize) = (besti - 1, bestj - 1, bestsize + 1);
        }
        while besti + bestsize < ahi
            && bestj + bestsize < bhi
            && a[besti + bestsize] == b[bestj + bestsize]
        {
            bestsize += 1;
        }
        (besti, bestj, bestsize)
    }

    fn matching_blocks(&self) -> Vec<(usize, usize, usize)> {
        let (la, lb) = (self.a.len(), self.b.len());
        let mut queue = vec![(0, la, 0, lb)];
        let mut blocks = Vec::new();
        while let Some((alo, ahi, blo, bhi)) = queue.pop() {
            let (i, j, k) = self.find_longest_match(alo, ahi, blo, bhi);
            if k > 0 {
                blocks.push((i, j, k));
                if alo < i && blo < j {
                    queue.push((alo, i, blo, j));
                }
                if i + k < ahi && j + k < bhi {
                    queue.push((i + k, ahi, j + k, bhi));
                }
            }
        }
        blocks.sort_unstable();
        // Collapse adjacent blocks.
        let (mut i1, mut j1, mut k1) = (0, 0, 0);
        let mut out = Vec::new();
        for (i2, j2, k2) in blocks {
            if i1 + k1 == i2 && j1 + k1 == j2 {
                k1 += k2;
            } else {
                if k1 > 0 {
                    out.push((i1, j1, k1));
                }
                (i1, j1, k1) = (i2, j2, k2);
            }
        }
        if k1 > 0 {
            out.push((i1, j1, k1));
        }
        out.push((la, lb, 0));
        out
    }

    fn opcodes(&self) -> Vec<Opcode> {
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        for (ai, bj, size) in self.matching_blocks() {
            let tag = match (i < ai, j < bj) {
                (true, true) => Some(Tag::Replace),
                (true, false) => Some(Tag::Delete),
                (false, true) => Some(Tag::Insert),
                (false, false) => None,
            };
            if let Some(tag) = tag {
                out.push(Opcode {
                    tag,
                    i1: i,
                    i2: ai,
                    j1: j,
                    j2: bj,
                });
            }
            (i, j) = (ai + size, bj + size);
            if size > 0 {
                out.push(Opcode {
                    tag: Tag::Equal,
                    i1: ai,
                    i2: i,
                    j1: bj,
                    j2: j,
                });
            }
        }
        out
    }

    /// The opcodes in hunks with up to `n` lines of context.
    fn grouped_opcodes(&self, n: usize) -> Vec<Vec<Opcode>> {
        let mut codes = self.opcodes();
        if codes.is_empty() {
            codes.push(Opcode {
                tag: Tag::Equal,
                i1: 0,
                i2: 1,
                j1: 0,
                j2: 1,
            });
        }
        if let Some(c) = codes.first_mut().filter(|c| c.tag == Tag::Equal) {
            c.i1 = c.i1.max(c.i2.saturating_sub(n));
            c.j1 = c.j1.max(c.j2.saturating_sub(n));
        }
        if let Some(c) = codes.last_mut().filter(|c| c.tag == Tag::Equal) {
            c.i2 = c.i2.min(c.i1 + n);
            c.j2 = c.j2.min(c.j1 + n);
        }
        let mut groups = Vec::new();
        let mut group = Vec::new();
        for mut c in codes {
            // A long unchanged stretch ends a hunk and starts the next.
            if c.tag == Tag::Equal && c.i2 - c.i1 > 2 * n {
                group.push(Opcode {
                    i2: c.i2.min(c.i1 + n),
                    j2: c.j2.min(c.j1 + n),
                    ..c
                });
                groups.push(std::mem::take(&mut group));
                c.i1 = c.i1.max(c.i2.saturating_sub(n));
                c.j1 = c.j1.max(c.j2.saturating_sub(n));
            }
            group.push(c);
        }
        let only_equal = group.len() == 1 && group[0].tag == Tag::Equal;
        if !group.is_empty() && !only_equal {
            groups.push(group);
        }
        groups
    }
}

/// Python's `'{}'` / `'{},{}'` hunk range of lines `start..stop`.
fn format_range(start: usize, stop: usize) -> String {
    let length = stop - start;
    match length {
        1 => format!("{}", start + 1),
        0 => format!("{start},0"),
        _ => format!("{},{length}", start + 1),
    }
}

/// `difflib.unified_diff(a, b, fromfile, tofile, n=n)` joined into one text.
pub(crate) fn unified_diff(
    a: &[&[u8]],
    b: &[&[u8]],
    fromfile: &str,
    tofile: &str,
    n: usize,
) -> Vec<u8> {
    let mut out = Vec::new();
    let groups = SequenceMatcher::new(a, b).grouped_opcodes(n);
    if !groups.is_empty() {
        out.extend_from_slice(format!("--- {fromfile}\n+++ {tofile}\n").as_bytes());
    }
    for group in groups {
        let (first, last) = (group[0], group[group.len() - 1]);
        let hunk = format!(
            "@@ -{} +{} @@\n",
            format_range(first.i1, last.i2),
            format_range(first.j1, last.j2)
        );
        out.extend_from_slice(hunk.as_bytes());
        for c in group {
            let mut emit = |prefix: u8, lines: &[&[u8]]| {
                for line in lines {
                    out.push(prefix);
                    out.extend_from_slice(line);
                }
            };
            match c.tag {
                Tag::Equal => emit(b' ', &a[c.i1..c.i2]),
                Tag::Replace => {
                    emit(b'-', &a[c.i1..c.i2]);
                    emit(b'+', &b[c.j1..c.j2]);
                }
                Tag::Delete => emit(b'-', &a[c.i1..c.i2]),
                Tag::Insert => emit(b'+', &b[c.j1..c.j2]),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::unified_diff;

    fn diff(a: &str, b: &str) -> String {
        let a: Vec<&[u8]> = a.split_inclusive('\n').map(str::as_bytes).collect();
        let b: Vec<&[u8]> = b.split_inclusive('\n').map(str::as_bytes).collect();
        String::from_utf8(unified_diff(&a, &b, "a/f", "b/f", 3)).unwrap()
    }

    // Expected texts are what CPython 3.11's difflib.unified_diff(..., "a/f", "b/f", n=3) returns.
    #[test]
    fn matches_python_on_small_inputs() {
        assert_eq!(diff("", ""), "");
        assert_eq!(diff("x\n", "x\n"), "");
        assert_eq!(
            diff("a\nb\nc\n", "a\nB\nc\n"),
            "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
        );
        assert_eq!(
            diff("a\n", "b\n"),
            "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
        );
        assert_eq!(diff("", "b\n"), "--- a/f\n+++ b/f\n@@ -0,0 +1 @@\n+b\n");
        assert_eq!(
            diff("a\nb", "a\nc"),
            "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b+c"
        );
        let a = "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n";
        let b = "1\nX\n3\n4\n5\n6\n7\n8\n9\n10\nY\n12\n";
        assert_eq!(
            diff(a, b),
            "--- a/f\n+++ b/f\n@@ -1,5 +1,5 @@\n 1\n-2\n+X\n 3\n 4\n 5\n@@ -8,5 +8,5 @@\n 8\n 9\n 10\n-11\n+Y\n 12\n"
        );
        let b2 = "1\nX\n3\n4\n5\n6\n7\n8\nY\n10\n11\n12\n";
        assert_eq!(
            diff(a, b2),
            "--- a/f\n+++ b/f\n@@ -1,12 +1,12 @@\n 1\n-2\n+X\n 3\n 4\n 5\n 6\n 7\n 8\n-9\n+Y\n 10\n 11\n 12\n"
        );
    }
}
