"""Documentation that cannot drift: every documented example of an analytic command is rerun and must print
what the page shows (``scripts/gen_docs`` rewrites them), and every relative link must lead somewhere."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from lab.cli import doc_examples as docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [docs.parse(path) for path in docs.default_pages(ROOT)]
EXAMPLES = [ex for page in PAGES for ex in page.examples]


def _id(ex: docs.Example) -> str:
    words = ["python"] if ex.python else [w for w in ex.argv if not w.startswith("-")][:2]
    return f"{ex.name}:{'-'.join(words)}"


@pytest.fixture(scope="module")
def scratch():
    with docs.sandbox(docs.example_files(PAGES), ROOT) as folder:
        yield folder


def test_the_pages_document_examples():
    assert len(EXAMPLES) >= 25, "the marked examples were not found: is the marker convention still parsed?"


# an example that compiles JAX programs runs in a fresh process, up to a minute for a real-size cross-compile
CHECKED = [pytest.param(ex, marks=pytest.mark.slow) if ex.jax else ex for ex in EXAMPLES]


@pytest.mark.parametrize("ex", CHECKED, ids=_id)
def test_documented_output_is_the_real_output(ex, scratch):
    shown = docs.current(ex)
    if not docs.matches(ex, shown):
        diff = "\n".join(difflib.unified_diff(ex.documented, shown, "documented", "now", lineterm=""))
        pytest.fail(f"{ex.name}: the output of `{ex.command}` changed; run ./scripts/gen_docs\n{diff}")


# --- the marker convention itself -------------------------------------------------------------------------------


def test_lines_keep_what_they_name_and_mark_each_gap():
    out = "\n".join(f"l{i}" for i in range(1, 11)) + "\n\n"
    assert docs.trim(out, "1..2,5,-2..") == ["l1", "l2", "...", "l5", "...", "l9", "l10"]
    assert docs.trim(out, "..3") == ["l1", "l2", "l3", "..."]
    assert docs.trim(out, "-3..") == ["...", "l8", "l9", "l10"]
    assert docs.trim(out, None) == [f"l{i}" for i in range(1, 11)]


def test_masks_except_timings_and_nothing_else(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        '<!-- example: mask="searched in \\S+ \\S+" -->\n```console\n$ shardlab hardware list\n'
        "12 fit; searched in 446 ms\n```\n"
    )
    (ex,) = docs.parse(page).examples
    assert docs.matches(ex, ["12 fit; searched in 1.2 s"])
    assert not docs.matches(ex, ["13 fit; searched in 446 ms"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- example -->\n```\n$ shardlab audit tp_mlp\n```\n", "compiles or runs JAX"),
        ("<!-- example -->\n```\n$ shardlab plan --validate 3\n```\n", "compiles or runs JAX"),
        ("<!-- example -->\n```\n$ ls\n```\n", "only shardlab commands"),
        ("<!-- example -->\nno block\n", "just above a fenced block"),
        ("<!-- example: head=3 -->\n```\n$ shardlab hardware list\n```\n", "unknown marker option"),
        ("<!-- example: lines=a..b -->\n```\n$ shardlab hardware list\n```\n", "bad lines= item"),
        ("<!-- example: jax -->\n```\n$ shardlab run experiments/tp_mlp.toml\n```\n", "profiles a run"),
    ],
)
def test_a_bad_marker_is_named_by_file_and_line(tmp_path, text, message):
    page = tmp_path / "p.md"
    page.write_text("intro\n\n" + text)
    with pytest.raises(docs.DocError, match=re.escape(message)) as err:
        docs.parse(page)
    assert "p.md:3" in str(err.value)


def test_a_jax_example_runs_in_a_fresh_process_on_eight_emulated_devices(tmp_path):
    """`example: jax` marks a compile whose output is the same wherever it runs: it runs in a new process with 8
    emulated devices and none of the caller's XLA flags (a test session's would change what XLA emits)."""
    page = tmp_path / "p.md"
    page.write_text("<!-- example: jax -->\n```\n$ shardlab audit sharded_matmul_case1\nstale\n```\n")
    (ex,) = docs.parse(page).examples
    assert ex.jax and ex.argv == ("audit", "sharded_matmul_case1")
    with docs.sandbox({}, ROOT):
        shown = docs.current(ex)
    assert shown[0].startswith("audit sharded_matmul_case1 on mesh X=2,Y=4 (cpu, emulated)")
    assert shown[-1] == "result: all match"


def test_regenerating_rewrites_a_stale_output_once(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- example: lines=1..3 -->\n```console\n$ shardlab hardware list\nstale\n```\n")
    assert len(docs.regenerate([docs.parse(page)])) == 1
    written = page.read_text()
    assert "stale" not in written and "tpu-v3" in written and "\n...\n```" in written
    assert docs.regenerate([docs.parse(page)]) == []
    assert page.read_text() == written


def test_a_python_session_shows_what_each_statement_prints(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- example -->\n```pycon\n>>> x = [1,\n...      2]\n>>> sum(x)\n4\n>>> print('a\\nb')\n```\n")
    (ex,) = docs.parse(page).examples
    assert ex.python
    assert docs.current(ex) == [">>> x = [1,", "...      2]", ">>> sum(x)", "3", ">>> print('a\\nb')", "a", "b"]
    assert not docs.matches(ex, docs.current(ex))


# --- links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", _fenceless(path.read_text(encoding="utf-8")), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(f"{slug}-{n}" if n else slug)
    return out


def _fenceless(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _links() -> list[tuple[Path, str]]:
    out = []
    for path in docs.default_pages(ROOT):
        text = path.read_text(encoding="utf-8")
        for target in LINK.findall(_fenceless(text)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
                out.append((path, target))
    return out


LINKS = _links()


def test_the_pages_have_links_to_check():
    assert len(LINKS) >= 20


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS])
def test_relative_links_lead_to_a_file(page, target):
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target!r}, but {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading for #{anchor} in {file or 'itself'}"
