"""The integration changes at most 20 lines of transformers' logic. Every such line in the shim carries a
`# [FW]` comment, and DESIGN.md's table lists each with the number of lines a patch to transformers
would change for it (the K/V allocation line stands for two). Lines that only exist because the shim
wraps whole methods carry `# [wrap]` and have their own table. Needs neither torch nor transformers."""

import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "valve_transformers"
DESIGN = ROOT / "DESIGN.md"


def marked(tag: str) -> list[tuple[str, int]]:
    found = []
    for path in sorted(PKG.glob("*.py")):
        with path.open("rb") as f:
            for tok in tokenize.tokenize(f.readline):
                if tok.type == tokenize.COMMENT and tok.string.startswith(f"# [{tag}]"):
                    found.append((path.name, tok.start[0]))
    return found


def fw_rows() -> list[int]:
    return [int(n) for n in re.findall(r"^\| FW-\d+ \| (\d+) \|", DESIGN.read_text(), flags=re.M)]


def test_at_most_20_changed_lines_of_framework_logic():
    rows = fw_rows()
    assert rows and sum(rows) <= 20, rows


def test_design_lists_every_marked_line():
    assert len(fw_rows()) == len(marked("FW")), (fw_rows(), marked("FW"))
    wraps = re.findall(r"^\| W-\d+ \|", DESIGN.read_text(), flags=re.M)
    assert len(wraps) == len(marked("wrap")), marked("wrap")


def test_the_fake_client_changes_no_framework_line():
    assert all(name != "_fake_valve.py" for name, _ in marked("FW") + marked("wrap"))
