//! Reading a tree, deciding, and writing the one-line change.

use std::collections::HashMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::bytes::Regex as BytesRegex;
use regex::Regex;
use sha2::{Digest, Sha256};

use crate::text::{read_text, rstrip_crlf, split_lines, universal_newlines, NOT_WS, WS};
use crate::{
    difflib, Flag, FlagValue, Outcome, PatchError, PatchOptions, Report, Status, API_LOCK_READONLY,
    CONTROL_H, GENERATED, METHOD_ID,
};

/// Builds a pattern where `{WS}` / `{NOT_WS}` stand for Python's `\s` / `\S`.
fn pattern(p: &str) -> String {
    p.replace("{WS}", WS).replace("{NOT_WS}", NOT_WS)
}

fn bytes_re(p: &str) -> BytesRegex {
    BytesRegex::new(&pattern(p)).expect("the applier's patterns are valid")
}

fn text_re(p: &str) -> Regex {
    Regex::new(&pattern(p)).expect("the applier's patterns are valid")
}

// The generated file is matched as bytes (lines keep any non-UTF-8 bytes); `(?s-u:.)` is any byte.
static METHOD_RE: LazyLock<BytesRegex> =
    LazyLock::new(|| bytes_re(r"/\*methodId=\*/{WS}*0x([0-9a-fA-F]+)u?{WS}*,"));
static FLAGS_RE: LazyLock<BytesRegex> = LazyLock::new(|| {
    bytes_re(r"^(?P<pre>{WS}*/\*flags=\*/{WS}*)0x(?P<hex>[0-9a-fA-F]+)(?P<suf>u?{WS}*,(?s-u:.)*)$")
});
static ENTRY_START_RE: LazyLock<BytesRegex> =
    LazyLock::new(|| bytes_re(r"^{WS}*\{{WS}*/\*{WS}*\[\d+\]{WS}*\*/"));
static MACRO_RE: LazyLock<BytesRegex> =
    LazyLock::new(|| bytes_re(r"^{WS}*#{WS}*define{WS}+NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG\b"));
static MACRO_ZERO_RE: LazyLock<BytesRegex> = LazyLock::new(|| {
    bytes_re(r"^{WS}*#{WS}*define{WS}+NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG\(x\){WS}+\(0\){WS}*$")
});
static FLAG_BITS_RE: LazyLock<Regex> =
    LazyLock::new(|| text_re(r"(?m)^#define{WS}+(RMCTRL_FLAGS_[A-Z0-9_]+){WS}+0x([0-9a-fA-F]+)"));
static VERSION_MK_RE: LazyLock<Regex> =
    LazyLock::new(|| text_re(r"(?m)^NVIDIA_VERSION{WS}*={WS}*({NOT_WS}+)"));
static NVVER_RE: LazyLock<Regex> =
    LazyLock::new(|| text_re(r#"(?m)^#define{WS}+NV_VERSION_STRING{WS}+"([^"]+)""#));

fn unsupported(message: String) -> PatchError {
    PatchError::Unsupported(message)
}

/// A hex literal the patterns above matched (`[0-9a-fA-F]+`).
fn hex_value(digits: &[u8]) -> FlagValue {
    std::str::from_utf8(digits)
        .ok()
        .and_then(FlagValue::from_hex)
        .expect("the patterns match only hex digits")
}

/// `NVIDIA_VERSION` from version.mk, else `NV_VERSION_STRING` from nvVer.h, else "unknown".
fn read_version(src: &Path) -> Result<String, PatchError> {
    for (name, re) in [
        ("version.mk", &*VERSION_MK_RE),
        ("src/common/inc/nvVer.h", &*NVVER_RE),
    ] {
        let path = src.join(name);
        if path.exists() {
            if let Some(c) = re.captures(&read_text(&path)?) {
                return Ok(c[1].to_string());
            }
        }
    }
    Ok("unknown".to_string())
}

/// All `RMCTRL_FLAGS_<NAME>` defines with a literal hex value (a later define wins).
fn flag_bits(control_h: &str) -> HashMap<String, FlagValue> {
    FLAG_BITS_RE
        .captures_iter(control_h)
        .map(|c| (c[1].to_string(), hex_value(c[2].as_bytes())))
        .collect()
}

/// The first `*.o_binary` file in the order Python's `os.walk` visits a tree (a directory's files
/// before its subdirectories, directory order as the file system lists it, symlinked directories
/// not entered, unreadable directories skipped), relative to the tree.
fn first_blob(dir: &Path, rel: &Path) -> Option<PathBuf> {
    let mut subdirs = Vec::new();
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        let is_dir = match entry.file_type() {
            Ok(t) if t.is_symlink() => fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()),
            Ok(t) => t.is_dir(),
            Err(_) => false,
        };
        if is_dir {
            subdirs.push(entry.file_name());
        } else {
            files.push(entry.file_name());
        }
    }
    if let Some(blob) = files
        .iter()
        .find(|f| f.as_encoded_bytes().ends_with(b".o_binary"))
    {
        return Some(rel.join(blob));
    }
    subdirs.into_iter().find_map(|name| {
        let path = dir.join(&name);
        let is_link = fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
        if is_link {
            None
        } else {
            first_blob(&path, &rel.join(&name))
        }
    })
}

/// Refuses what is not an open-gpu-kernel-modules source tree; returns the generated file and
/// control.h.
fn check_tree(src: &Path) -> Result<(PathBuf, PathBuf), PatchError> {
    let s = src.display();
    if !src.is_dir() {
        return Err(PatchError::Usage(format!("{s}: no such directory")));
    }
    let (gen, ctl) = (src.join(GENERATED), src.join(CONTROL_H));
    if !gen.exists() {
        if let Some(blob) = first_blob(src, Path::new("")) {
            return Err(PatchError::Proprietary(format!(
                "{s} has a prebuilt resource manager ({}) and no {GENERATED}: this is a packaged kernel interface \
                 (the proprietary driver, or a distribution's nvidia-open-kernel-source), not the \
                 open-gpu-kernel-modules source. Get the source tree of the same version (the NVIDIA \
                 open-gpu-kernel-modules tag, or the distribution's source package)",
                blob.display()
            )));
        }
        return Err(unsupported(format!(
            "{s} is not an open-gpu-kernel-modules tree: {GENERATED} is missing"
        )));
    }
    if !ctl.exists() {
        return Err(unsupported(format!(
            "{s}: {CONTROL_H} is missing; cannot read the flag values of this version"
        )));
    }
    Ok((gen, ctl))
}

/// The generated file, split into lines as the applier sees them.
struct Lines {
    text: Vec<u8>,
    spans: Vec<Range<usize>>,
}

impl Lines {
    fn get(&self, i: usize) -> &[u8] {
        &self.text[self.spans[i].clone()]
    }

    fn all(&self) -> Vec<&[u8]> {
        self.spans.iter().map(|r| &self.text[r.clone()]).collect()
    }
}

/// Index of the single `/*flags=*/` line of the entry whose `/*methodId=*/` line is `at`: looks
/// back at most 15 lines, stopping at the entry's start or another entry's method id.
fn entry_flags_line(lines: &Lines, at: usize) -> Result<usize, PatchError> {
    let mut flag_lines = Vec::new();
    for i in (at.saturating_sub(15)..at).rev() {
        let line = lines.get(i);
        if ENTRY_START_RE.is_match(line) || METHOD_RE.is_match(line) {
            break;
        }
        if FLAGS_RE.is_match(rstrip_crlf(line)) {
            flag_lines.push(i);
        }
    }
    match flag_lines.as_slice() {
        [one] => Ok(*one),
        _ => Err(unsupported(format!(
            "the {METHOD_ID:#x} entry in {GENERATED} (line {}) has {} /*flags=*/ lines; expected exactly one",
            at + 1,
            flag_lines.len()
        ))),
    }
}

/// The entry's flags value is repeated in `#if NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(...)` lines.
/// Changing only the `/*flags=*/` line is complete only while that macro ignores its argument, as
/// it does in every generated file of 525-595 (defined as `(0)` in the file itself). Anything else:
/// do not guess.
fn check_disable_macro(lines: &Lines) -> Result<(), PatchError> {
    let defines: Vec<&[u8]> = lines
        .all()
        .into_iter()
        .filter(|l| MACRO_RE.is_match(l))
        .collect();
    match defines.as_slice() {
        [one] if MACRO_ZERO_RE.is_match(one) => Ok(()),
        _ => Err(unsupported(format!(
            "{GENERATED} does not define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x) as (0); the flags value may \
             matter elsewhere in the file, so a one-line change is not safe"
        ))),
    }
}

/// The line index of the one exported-method entry with [`METHOD_ID`].
fn find_entry(lines: &Lines) -> Result<usize, PatchError> {
    let wanted = FlagValue::from(u64::from(METHOD_ID));
    let hits: Vec<usize> = (0..lines.spans.len())
        .filter(|&i| {
            METHOD_RE
                .captures(lines.get(i))
                .is_some_and(|c| hex_value(&c[1]) == wanted)
        })
        .collect();
    match hits.as_slice() {
        [] => Err(unsupported(format!(
            "{GENERATED} has no exported-method entry with methodId {METHOD_ID:#x}"
        ))),
        [one] => Ok(*one),
        many => Err(unsupported(format!(
            "{GENERATED} has {} entries with methodId {METHOD_ID:#x}; refusing to guess",
            many.len()
        ))),
    }
}

/// The flag's bit from control.h, checking that control.h also defines `API_LOCK_READONLY`.
fn read_bits(ctl: &Path, flag: Flag) -> Result<(FlagValue, FlagValue), PatchError> {
    let flag_name = flag.define();
    let mut bits = flag_bits(&read_text(ctl)?);
    let mut take = |needed: &str| {
        bits.remove(needed).ok_or_else(|| {
            unsupported(format!(
                "{CONTROL_H} does not define {needed}: unknown driver version layout"
            ))
        })
    };
    let bit = take(flag_name)?;
    let api = take(API_LOCK_READONLY)?;
    if !bit.is_single_bit() {
        return Err(unsupported(format!(
            "{flag_name} is {bit} in {CONTROL_H}, not a single bit"
        )));
    }
    Ok((bit, api))
}

/// A tree the applier accepts, read and decided, with nothing written yet.
pub struct Plan {
    /// What was found, as printed before anything is written.
    pub report: Report,
    generated: PathBuf,
    lines: Lines,
    /// Index of the entry's flags line.
    idx: usize,
    /// Where the hex digits of that line's value start and end (inside the line).
    value: Range<usize>,
}

/// Reads the tree at `src` and decides what the patch would change, or refuses: a [`PatchError`]
/// for anything the one-line change would not be right for.
pub fn plan(src: &Path, flag: Flag) -> Result<Plan, PatchError> {
    let (generated, ctl) = check_tree(src)?;
    let (bit, api) = read_bits(&ctl, flag)?;
    let raw = fs::read(&generated).map_err(|e| PatchError::io(&generated, e))?;
    let text = universal_newlines(&raw);
    let spans = split_lines(&text);
    let lines = Lines { text, spans };
    check_disable_macro(&lines)?;
    let idx = entry_flags_line(&lines, find_entry(&lines)?)?;
    let caps = FLAGS_RE
        .captures(rstrip_crlf(lines.get(idx)))
        .expect("entry_flags_line matched this line");
    let hex = caps.name("hex").expect("the pattern has a hex group");
    let old = hex_value(hex.as_bytes());
    // GPU_LOCK_DEVICE_ONLY narrows only the GPU lock. If the control also takes the API lock for
    // write (the 525 branch: flags lack API_LOCK_READONLY), calls for different GPUs still run one
    // at a time behind that lock, so the patch would change nothing measurable: refuse.
    if flag == Flag::GpuLockDeviceOnly && !old.intersects(&bit) && !old.intersects(&api) {
        return Err(unsupported(format!(
            "the entry's flags {old} lack {API_LOCK_READONLY} ({api}): RM takes the API lock for write for this \
             control in this version, so a per-GPU lock would not let GPUs be preempted in parallel. Use a 535 \
             or newer driver (see docs/driver-patch.md)"
        )));
    }
    let value = (hex.start() - 2)..hex.end();
    let new = old.or(&bit);
    let report = Report {
        version: read_version(src)?,
        line: idx + 1,
        flag,
        old,
        new,
        bit,
    };
    Ok(Plan {
        report,
        generated,
        lines,
        idx,
        value,
    })
}

impl Plan {
    /// The flags line with `value` in place of the old one (same prefix, suffix and ending).
    fn line_with(&self, value: &FlagValue) -> Vec<u8> {
        let line = self.lines.get(self.idx);
        let mut out = line[..self.value.start].to_vec();
        out.extend_from_slice(value.to_string().as_bytes());
        out.extend_from_slice(&line[self.value.end..]);
        out
    }

    /// The unified diff of the change: unpatched -> patched, whether or not the tree is patched
    /// already (so the emitted file is the same either way).
    pub fn diff(&self) -> Vec<u8> {
        let report = &self.report;
        let mut before = self.lines.all();
        let mut after = before.clone();
        let (unpatched, patched);
        if report.is_patched() {
            unpatched = self.line_with(&report.old.and_not(&report.bit));
            before[self.idx] = &unpatched;
        } else {
            patched = self.line_with(&report.new);
            after[self.idx] = &patched;
        }
        difflib::unified_diff(
            &before,
            &after,
            &format!("a/{GENERATED}"),
            &format!("b/{GENERATED}"),
            3,
        )
    }

    /// Does what the plan says: nothing for a patched tree (but writes `emit_patch`), nothing with
    /// `check`, else replaces the generated file (through a temporary file and a rename) and writes
    /// `emit_patch`. `opts.flag` is ignored: the plan was made for one flag.
    pub fn apply(&self, opts: &PatchOptions) -> Result<Status, PatchError> {
        let write =
            |path: &Path, bytes: &[u8]| fs::write(path, bytes).map_err(|e| PatchError::io(path, e));
        if self.report.is_patched() {
            if let Some(path) = &opts.emit_patch {
                write(path, &self.diff())?;
            }
            return Ok(Status::AlreadyPatched);
        }
        if opts.check {
            return Ok(Status::NotPatched);
        }
        let diff = self.diff();
        let span = self.lines.spans[self.idx].clone();
        let mut text = self.lines.text[..span.start].to_vec();
        text.extend_from_slice(&self.line_with(&self.report.new));
        text.extend_from_slice(&self.lines.text[span.end..]);
        let mut tmp = self.generated.clone().into_os_string();
        tmp.push(".valve-tmp");
        let tmp = PathBuf::from(tmp);
        write(&tmp, &text)?;
        fs::rename(&tmp, &self.generated).map_err(|e| PatchError::io(&self.generated, e))?;
        if let Some(path) = &opts.emit_patch {
            write(path, &diff)?;
        }
        let sha256 = Sha256::digest(&diff)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Status::Patched { sha256 })
    }
}

/// Plans and applies: sets the flag in the tree at `src` (idempotent), or with `opts.check` only
/// reports. Nothing is changed on an error (except by an I/O failure while writing).
pub fn patch(src: &Path, opts: &PatchOptions) -> Result<Outcome, PatchError> {
    let plan = plan(src, opts.flag)?;
    let status = plan.apply(opts)?;
    Ok(Outcome {
        report: plan.report,
        status,
    })
}

/// `patch --check`: reports patched (exit 0) / not patched (10) / refused; changes nothing.
pub fn check(src: &Path, flag: Flag) -> Result<Outcome, PatchError> {
    patch(
        src,
        &PatchOptions {
            flag,
            check: true,
            emit_patch: None,
        },
    )
}

/// The unified diff that `patch --emit-patch FILE` writes for this tree (the same text whether the
/// tree is patched yet or not); changes nothing. Bytes, because the generated file need not be
/// UTF-8; for NVIDIA's trees it is ASCII.
pub fn emit_patch(src: &Path, flag: Flag) -> Result<Vec<u8>, PatchError> {
    Ok(plan(src, flag)?.diff())
}
