//! Where a shared library's exported functions sit in its file: the offsets uprobes attach to.
//! Read once per watcher, so neither a uprobe.multi link nor each process's probes parse it again.

use std::collections::HashMap;
use std::path::Path;

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

use crate::WatchError;

/// The file offset of each of `names` that `library` defines as a function (in its dynamic
/// symbol table, else its full one); names it does not define are left out.
pub(crate) fn function_offsets(
    library: &Path,
    names: &[&'static str],
) -> Result<HashMap<&'static str, u64>, WatchError> {
    let image = std::fs::read(library)
        .map_err(|e| WatchError::Thread(format!("reading {}: {e}", library.display())))?;
    offsets_in(&image, names).map_err(|e| {
        WatchError::Thread(format!(
            "{} is not an ELF library uprobes can attach to: {e}",
            library.display()
        ))
    })
}

fn offsets_in(
    image: &[u8],
    names: &[&'static str],
) -> Result<HashMap<&'static str, u64>, object::Error> {
    let file = object::File::parse(image)?;
    let mut found = HashMap::new();
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.kind() != SymbolKind::Text || !sym.is_definition() {
            continue;
        }
        let Some(&name) = sym
            .name()
            .ok()
            .and_then(|n| names.iter().find(|&&w| w == n))
        else {
            continue;
        };
        let Some(section) = sym
            .section_index()
            .and_then(|i| file.section_by_index(i).ok())
        else {
            continue;
        };
        let Some((section_offset, _)) = section.file_range() else {
            continue;
        };
        let offset = sym.address() - section.address() + section_offset;
        found.entry(name).or_insert(offset);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// x86-64 for `return 0x5a5a0001 + k`: `mov eax, imm32; ret`, maybe after `endbr64`.
    fn returns(code: &[u8], value: u32) -> bool {
        let code = code.strip_prefix(&[0xf3, 0x0f, 0x1e, 0xfa]).unwrap_or(code);
        let mut want = vec![0xb8];
        want.extend_from_slice(&value.to_le_bytes());
        want.push(0xc3);
        code.starts_with(&want)
    }

    #[test]
    fn finds_defined_functions_at_their_code_and_not_a_name_that_is_only_a_string() {
        if !cfg!(target_arch = "x86_64") {
            eprintln!("SKIP: the check reads x86-64 machine code");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("lib.c");
        std::fs::write(
            &src,
            "int cuLaunchKernel(void) { return 0x5a5a0001; }\n\
             int cuGraphLaunch(void) { return 0x5a5a0002; }\n\
             extern int cuCtxSynchronize(void);\n\
             int calls(void) { return cuCtxSynchronize(); }\n\
             const char *name = \"cuStreamSynchronize\";\n",
        )
        .unwrap();
        let lib = dir.path().join("libfake.so");
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .status()
            .expect("cc runs");
        assert!(built.success());
        let names = [
            "cuLaunchKernel",
            "cuGraphLaunch",
            "cuCtxSynchronize",
            "cuStreamSynchronize",
        ];
        let found = function_offsets(&lib, &names).unwrap();
        let image = std::fs::read(&lib).unwrap();
        let code = |n: &str| &image[found[n] as usize..];
        assert!(returns(code("cuLaunchKernel"), 0x5a5a_0001), "{found:?}");
        assert!(returns(code("cuGraphLaunch"), 0x5a5a_0002), "{found:?}");
        // Imported (undefined here) and a string only: neither is a function to probe.
        assert_eq!(found.len(), 2, "{found:?}");
    }

    #[test]
    fn a_file_that_is_not_elf_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libcuda.so.1");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let e = function_offsets(&p, &["cuLaunchKernel"]).unwrap_err();
        assert!(e.to_string().contains("not an ELF library"), "{e}");
    }
}
