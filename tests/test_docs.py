"""The docs describe the project as it is: README.md within 350 lines, every relative link
(and ``#anchor``) in README.md, docs/*.md and benchmarks/README.md pointing at a file (and a
heading) that exists, every capability of README's feature table linked to its page, no commit
hashes in them, and no absolute path of the machine the project was written on (its workspace,
home and root directories, a run's temporary directory) in any tracked file, and no tracked file
citing a text that is not in the repository (a numbered "seed" text)."""
from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

# [text](target) outside code; images too. Targets with a scheme (https:, mailto:) are external.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEX = re.compile(r"(?<![0-9A-Za-z_])[0-9a-fA-F]{7,40}(?![0-9A-Za-z_])")
# The workspace, home and root directories of a machine, and a run's temporary directory, as the
# start of an absolute path (not the tail of a relative one or a URL); spelled so that this file
# does not match itself.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:(?:" + "|".join(["wo" + "rk", "ho" + "me", "ro" + "ot", "Us" + "ers"])
                          + r")(?![\w.-])|" + "t" + "mp/)")
# A citation of a numbered seed text ("seed 003", "Seed 000/003"): the repository must stand alone,
# so comments name the formula or the public paper instead. Spelled so that this file does not
# match itself.
SEED_CITATION = re.compile(r"\b" + "se" + r"ed\s+\d{3}\b", re.I)


def git(*args, **kw):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, **kw)


def in_git_checkout() -> bool:
    try:
        return git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except OSError:
        return False


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens. ``slug("Export for `torchrun`") == "export-for-torchrun"``."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = "".join(c for c in text if c in "- " or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    found, seen = set(), {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def prose(path: Path) -> str:
    """The file without fenced code blocks or inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", path.read_text()))


def test_readme_within_350_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 350, f"README.md has {lines} lines; move detail to a page under docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # external (https:, mailto:)
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_feature_table_links_every_capability_to_a_page():
    """Each row of the README's feature table names a capability and links to its page."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Features\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Features' section"
    rows = [l for l in section.group(1).splitlines() if l.startswith("|") and not re.match(r"\|\s*-", l)][1:]
    assert len(rows) >= 10, rows
    for row in rows:
        links = [t for t in LINK.findall(row) if t.startswith("docs/")]
        assert links, f"feature row without a link to its page under docs/: {row}"
        for t in links:
            assert (ROOT / t.partition("#")[0]).exists(), t


def hex_tokens(text: str) -> set:
    return set(HEX.findall(text))


def test_hex_token_pattern():
    """The pattern finds hashes wherever they stand, and not words such as fp32 or bf16."""
    assert hex_tokens("on `5c32442`, (b30c2e7) fp32 bf16 0xff 4,096 deadbeef") == {"5c32442", "b30c2e7", "deadbeef"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes(doc):
    """No 7-40 character hex token mixing letters and digits (how a commit hash looks), and
    none that git resolves to a commit (a hash of digits or letters only)."""
    tokens = hex_tokens(doc.read_text())
    mixed = sorted(t for t in tokens if re.search(r"[a-fA-F]", t) and re.search(r"[0-9]", t))
    assert not mixed, f"{doc.relative_to(ROOT)}: hex tokens that look like commit hashes: {mixed}"
    if not in_git_checkout() or not tokens:
        return
    out = git("cat-file", "--batch-check", input="".join(f"{t}^{{commit}}\n" for t in sorted(tokens))).stdout
    commits = [t for t, line in zip(sorted(tokens), out.splitlines()) if " commit " in line]
    assert not commits, f"{doc.relative_to(ROOT)}: tokens that name commits: {commits}"


def test_machine_path_pattern():
    """The pattern finds absolute paths of a machine, not relative paths, URLs or words."""
    tmp, work, root = "/t" + "mp/", "/wo" + "rk", "/ro" + "ot"
    for found in [f"cd {work}/main", f"out={tmp}pytest-of-x/y", f"`{root}/.cache`", f"({root})", f"HOME={work}"]:
        assert MACHINE_PATH.search(found), found
    for fine in ["tests/helpers/" + "t" + "mp/x", "https://example.com" + work, "tmp_path / 'out'", "<root>",
                 work + "space" + "/x", "~" + work]:
        assert not MACHINE_PATH.search(fine), fine


def tracked_lines_matching(pattern, skip=()) -> list:
    """``name:line: text`` for every line of a tracked text file (but ``skip``) that ``pattern``
    finds; skips the test outside a git checkout (no list of tracked files)."""
    if not in_git_checkout():
        pytest.skip("not a git checkout: no list of tracked files")
    hits = []
    for name in git("ls-files", "-z").stdout.split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or name in skip:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    return hits


def test_no_machine_paths_in_tracked_files():
    hits = tracked_lines_matching(MACHINE_PATH)
    assert not hits, "absolute paths of this machine:\n" + "\n".join(hits)


def test_seed_citation_pattern():
    """The pattern finds a numbered seed citation, not a random seed or a seeded backward."""
    word = "se" + "ed"
    for found in [f"({word} 000)", f"{word.title()} 003, Table 13.4", f"{word.upper()} 002 fill-drain",
                  f"{word}  000/003"]:
        assert SEED_CITATION.search(found), found
    for fine in [f"manual_{word}(0)", f"{word}=123", f"{word}s the backward with 1", f"{word} 1/M", f"{word}ed 1234"]:
        assert not SEED_CITATION.search(fine), fine


def test_no_citations_of_texts_outside_the_repository():
    hits = tracked_lines_matching(SEED_CITATION, skip=("tests/test_docs.py",))
    assert not hits, ("citations of texts that are not in the repository (name the formula or paper):\n"
                      + "\n".join(hits))
