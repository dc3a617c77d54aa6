"""The README and docs/ are tested, not trusted: every command a user would paste runs here,
and every link leads somewhere.

Blocks fenced as ```sh run as one bash script each, blocks fenced as ```python or ```py
with the project's interpreter, all in a scratch directory that holds what a fresh clone holds
after `make demo` (the virtualenv and the example files, linked). A block that cannot run
offline or in a test (it needs an API key, or is the setup command itself) is preceded by
`<!-- readme-test: skip: <why> -->`, and the reason is required; a block a test file runs
itself says `run ... by tests/<file>`, and that file must hold it. Every other block (fenced
with another language or none, or indented) is not run, so it may hold no command: a
line that starts as one (`wmo-trio`, `harbor`, `.venv/bin/...`) fails the test, wherever it
stands. The same holds for every `docs/*.md`.

The README is the front page, at most 350 lines, and links every page of docs/; a link
in any of them names a file that exists and, after `#`, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.readme import (
    _FENCE,
    README,
    ROOT,
    RUN_AS,
    Block,
    all_blocks,
    blocks,
    make_clone,
    run_as_written,
)

FRONT_PAGE_LINES = 350
# The first word of a line a reader would paste into a shell.
_COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:\S+=\S+\s+)*(?:\.venv/bin/\S+|\.?/?\S*wmo-trio|harbor"
                      r"|make|pip|python3?|uv|bash|sh)(?:\s|$)")


def documents() -> list[Path]:
    """The README and every page of docs/ (none may exist yet)."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]










def test_the_readme_has_blocks_to_run_and_says_why_it_skips_any() -> None:
    found = [block for file in documents() for block in blocks(file)]
    assert sum(block.skip is None for block in found) >= 4
    for block in found:
        assert block.skip is None or block.skip.strip(), f"{block.where}: skipped with no reason"


def test_every_python_block_of_the_docs_runs() -> None:
    """```py ran nowhere: docs/compare.md's first one failed as written (`Path` never
    imported)."""
    python = [block for file in documents() for block in all_blocks(file)
              if block.lang in ("py", "python")]
    assert len(python) >= 4
    assert [block.where for block in python if block not in blocks(block.file)] == []


# A skip's reason that names the test file which runs the block instead.
_RUN_BY = re.compile(r"\brun\b.*\bby tests/(?P<module>test_\w+)\.py\b")


def test_a_block_skipped_as_run_by_a_test_file_is_held_there() -> None:
    """That file holds the block it runs (as parsed here) as a value of its module: renamed,
    gone, or running another block, its skip would hide a block that nothing runs."""
    import importlib

    for block in (block for file in documents() for block in blocks(file)):
        by = _RUN_BY.search(block.skip or "")
        if by is not None:
            held = vars(importlib.import_module(by["module"])).values()
            assert block in held, (f"{block.where} is skipped as run by tests/{by['module']}.py, "
                                   "which does not hold it: run it there, or here")


@pytest.mark.parametrize("file", documents(), ids=lambda file: file.name)
def test_every_command_in_the_docs_stands_in_a_block_that_runs(file: Path) -> None:
    """A command in a block that is not run (indented, or fenced without `sh`) is never
    tested, and breaks unseen: `wmo-trio sandbox images` stood indented, without the
    `.venv/bin/` every other command has, and failed when pasted."""
    for block in all_blocks(file):
        if block.lang in RUN_AS:
            continue
        commands = [line for line in block.body.splitlines() if _COMMAND.match(line)]
        assert not commands, (f"{block.where}: {commands[0].strip()!r} is a command in a block "
                              "that is not run; fence the block as ```sh (or ```python)")


def test_an_indented_command_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```sh\nmake demo\n```\n\n    wmo-trio sandbox images   # the "
                    "cache\n    wmo-trio sandbox prune\n\nMore text.\n")
    fenced, indented = all_blocks(page)
    assert (fenced.lang, fenced.line, indented.lang, indented.line) == ("sh", 4, "indented", 7)
    assert [bool(_COMMAND.match(line)) for line in indented.body.splitlines()] == [True, True]


# A markdown link or image: `[text](target)`, the target up to a space (a title) or `)`.
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\((?P<target><[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")


def prose(file: Path) -> str:
    """`file` without its code: fenced blocks, indented blocks and inline code spans, which
    show links as text rather than making them."""
    text = _FENCE.sub("", file.read_text())
    for block in all_blocks(file):
        if block.lang == "indented":
            text = text.replace(block.body.replace("\n", "\n    ").rstrip(" "), "")
    return re.sub(r"(`+).+?\1", "", text, flags=re.S)


def anchors(file: Path) -> set[str]:
    """The fragment of each heading of `file`, as GitHub makes it: its text without markup,
    lower case, with punctuation but `-` and `_` dropped and spaces made `-`; a repeated
    heading gets `-1`, `-2`, ..."""
    found: set[str] = set()
    for line in _FENCE.sub("", file.read_text()).splitlines():
        heading = _HEADING.match(line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading["text"]).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        unique, count = slug, 0
        while unique in found:
            count += 1
            unique = f"{slug}-{count}"
        found.add(unique)
    return found


def broken_links(file: Path) -> list[str]:
    """Each link of `file` to a file that does not exist, or to a heading its file lacks."""
    broken = []
    for match in _LINK.finditer(prose(file)):
        target = match["target"].strip("<>")
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, fragment = target.partition("#")
        linked = (file.parent / path).resolve() if path else file
        if not linked.exists():
            broken.append(f"{match[0]}: no file {path}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{match[0]}: {linked.name} has no heading #{fragment}")
    return broken


def unlinked_pages(readme: Path) -> list[str]:
    """The pages of the docs/ beside `readme` that it does not link."""
    linked = {(readme.parent / match["target"].strip("<>").partition("#")[0]).resolve()
              for match in _LINK.finditer(prose(readme))}
    return [page.name for page in sorted((readme.parent / "docs").glob("*.md"))
            if page.resolve() not in linked]


def test_the_readme_is_a_front_page_that_links_every_docs_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= FRONT_PAGE_LINES, (
        f"README.md has {lines} lines: reference prose belongs in a page of docs/")
    unlinked = unlinked_pages(README)
    assert not unlinked, f"README.md does not link these pages of docs/: {', '.join(unlinked)}"


@pytest.mark.parametrize("file", documents(), ids=lambda file: file.name)
def test_every_link_reaches_a_file_and_its_heading(file: Path) -> None:
    broken = broken_links(file)
    assert not broken, f"{file.name}: broken links:\n" + "\n".join(broken)


def test_a_broken_link_and_an_unlinked_page_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# The guide\n\n## Keyword `arguments`: all of them\n\n## Keyword `arguments`: all of them\n\n"
        "Back [home](../README.md), [here](#keyword-arguments-all-of-them-1), "
        "[missing](#keyword-arguments) and `[in code](gone.md)`.\n\n"
        "```\n[in a block](gone.md)\n```\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Nobody links here\n")
    readme = tmp_path / "README.md"
    readme.write_text("# Front\n\n[The guide](docs/guide.md#the-guide), [gone](docs/gone.md), "
                      "![a plot](docs/plot.png) and [the web](https://example.org/x.md).\n")
    assert broken_links(readme) == ["[gone](docs/gone.md): no file docs/gone.md",
                                    "![a plot](docs/plot.png): no file docs/plot.png"]
    assert broken_links(tmp_path / "docs" / "guide.md") == [
        "[missing](#keyword-arguments): guide.md has no heading #keyword-arguments"]
    assert unlinked_pages(readme) == ["orphan.md"]


def test_the_readmes_benchmark_summary_is_the_headline_of_the_benchmarks_page() -> None:
    """`make bench` writes both; a hand edit of one, or a run that wrote only one, would
    leave the front page telling other figures than the page it links."""
    from benchmarks.__main__ import DOCS_PAGE, SUMMARY, TABLES, headline

    def between(path: Path, markers: tuple[str, str]) -> str:
        return path.read_text().split(markers[0] + "\n", 1)[1].split(markers[1], 1)[0]

    summary = between(README, SUMMARY)
    assert summary.count("\n| ") >= 5
    assert summary == headline(between(DOCS_PAGE, TABLES))


def test_the_docs_code_runtime_program_is_the_example_that_runs() -> None:
    """The docs show a `code:runtime` program and run `examples/code-runtime.json`: they
    are one program, so what the docs show is what their command runs."""
    import json

    [shown] = [block.body for file in documents() for block in all_blocks(file)
               if block.lang == "py" and block.body.startswith("def run(kit):")]
    document = json.loads((ROOT / "examples" / "code-runtime.json").read_text())
    [surface] = [s for s in document["surfaces"] if s["id"] == "code:runtime"]
    assert shown == surface["content"]
    assert any("--harness examples/code-runtime.json" in block.body for block in _TO_RUN)




@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clone(tmp_path_factory.mktemp("clone"))


_TO_RUN = [block for file in documents() for block in blocks(file) if block.skip is None]


def first_block_running(command: str) -> Block:
    found = [block for block in _TO_RUN if command in block.body]
    assert found, f"no block of the docs runs {command!r}"
    return found[0]


# Harbor's telemetry as a user has it, on, for the first block that starts a job through
# each command line (harbor's, with the README's export; ours, which sets that variable
# itself): building its job-end event imports litellm, whose download of its cost map is
# what the docs' commands must not set off. Every other job pays for no litellm import, as
# in the rest of the suite: the check needs one job of each kind, not every job.
_TELEMETRY_ON = {first_block_running("harbor run"), first_block_running("wmo-trio run")}


@pytest.mark.slow  # every block is a subprocess, harbor jobs among them
@pytest.mark.parametrize("block", _TO_RUN,
                         ids=[f"{b.file.stem}-line-{b.line}" for b in _TO_RUN])
def test_a_readme_block_runs_as_written(block: Block, clone: Path) -> None:
    run_as_written(block, clone, telemetry=block in _TELEMETRY_ON)




