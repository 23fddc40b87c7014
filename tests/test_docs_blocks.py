"""Every ```python block in docs/*.md runs as written.

For each page (docs/api/ is generated reference and has no runnable blocks), the page's ```python
fenced blocks are extracted in order and run top to bottom in one fresh namespace, in a subprocess
of their own (TensorFlow and torch must not load in one process, and a page must not see another
page's state), with a temporary directory as cwd and a timeout. One test per page.

A block opts out with an HTML comment on the line before its fence (keep these few, each with a
reason):

    <!-- docs-test: skip (needs a GPU) -->          not run
    <!-- docs-test: distributed -->                 run apart, under
                                                     `python -m torch.distributed.run --nproc-per-node 2`
                                                     (gloo, CPU), with the page's earlier blocks first

```bash blocks are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
TIMEOUT_S = int(os.environ.get("DPCORE_DOCS_TIMEOUT", "300"))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_MARK = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[a-z-]+)\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int         # 1-based line of the opening fence
    code: str
    mark: str | None  # None, "skip" or "distributed"
    reason: str


def extract_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, in order, with their docs-test marks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        lang = (m["info"].split() or [""])[0].lstrip(".").lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            c = _FENCE.match(lines[i])
            if c and c["fence"][0] == fence[0] and len(c["fence"]) >= len(fence) and not c["info"].strip():
                break
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in ("python", "py", "python3"):
            continue
        mark, reason = None, ""
        if start > 0:
            mm = _MARK.match(lines[start - 1])
            if mm:
                mark, reason = mm["kind"], mm["reason"].strip("() ")
                if mark not in ("skip", "distributed"):
                    raise ValueError(f"{path.name}:{start}: unknown docs-test mark {mark!r}")
        code = textwrap.dedent("\n".join(body)) if indent else "\n".join(body)
        blocks.append(Block(path.name, start + 1, code, mark, reason))
    return blocks


def page_script(blocks: list[Block]) -> str:
    """A script that runs the blocks in one namespace, naming the failing block on error."""
    parts = [
        "import sys, traceback",
        "_ns = {'__name__': '__main__'}",
        "def _run(_src, _where):",
        "    try:",
        "        exec(compile(_src, _where, 'exec'), _ns)",
        "    except BaseException:",
        "        traceback.print_exc()",
        "        print(f'docs-test: block at {_where} failed', file=sys.stderr)",
        "        sys.exit(1)",
    ]
    for b in blocks:
        parts.append(f"_run({b.code!r}, {f'{b.page}:{b.line}'!r})")
    return "\n".join(parts) + "\n"


def run_page(path: Path, tmp: Path, timeout: int = TIMEOUT_S) -> list[str]:
    """Run a page's blocks; returns the list of failures (empty when every block ran)."""
    blocks = extract_blocks(path)
    plain = [b for b in blocks if b.mark is None]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
    failures = []

    def go(script: Path, argv: list[str]) -> None:
        try:
            r = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            failures.append(f"{script.name}: timed out after {timeout} s")
            return
        if r.returncode != 0:
            failures.append(f"{script.name} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}"
                            f"\n--- stderr\n{r.stderr[-8000:]}")

    if plain:
        script = tmp / f"docs_{path.stem}.py"
        script.write_text(page_script(plain), encoding="utf-8")
        go(script, [sys.executable, str(script)])
    for k, b in enumerate(blocks):
        if b.mark != "distributed":
            continue
        # the page's earlier plain blocks set the scene (imports, model, data), then this block
        before = [p for p in plain if p.line < b.line]
        script = tmp / f"docs_{path.stem}_dist{k}.py"
        script.write_text(page_script(before + [b]), encoding="utf-8")
        go(script, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(script)])
    return failures


PAGES = sorted(p for p in DOCS.glob("*.md"))
#: The pages with a block to run (a page of prose and bash blocks only has nothing to test).
CODE_PAGES = [p.name for p in PAGES if any(b.mark != "skip" for b in extract_blocks(p))]


def test_the_pages_with_code_are_collected() -> None:
    for name in ("quickstart.md", "pytorch.md", "keras.md", "accounting.md", "distributed.md", "opacus.md"):
        assert name in CODE_PAGES


@pytest.mark.parametrize("page", CODE_PAGES)
def test_docs_page(page: str, tmp_path: Path) -> None:
    path = DOCS / page
    failures = run_page(path, tmp_path)
    assert not failures, f"{page}:\n" + "\n\n".join(failures)


# --- the collector itself -------------------------------------------------------------------------

def _page(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "page.md"
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    (tmp_path / "run").mkdir()
    return p


def test_collector_passes_a_good_page(tmp_path: Path) -> None:
    p = _page(tmp_path, """\
        # A page

        ```python
        x = 41
        ```

        Text, then a bash block that is not run:

        ```bash
        exit 1
        ```

        ```python
        assert x + 1 == 42
        print(x)
        ```
        """)
    blocks = extract_blocks(p)
    assert [b.line for b in blocks] == [3, 13]
    assert run_page(p, tmp_path / "run", timeout=60) == []


def test_collector_fails_a_planted_typo(tmp_path: Path) -> None:
    p = _page(tmp_path, """\
        ```python
        value = 1
        ```

        ```python
        print(valeu)
        ```
        """)
    failures = run_page(p, tmp_path / "run", timeout=60)
    assert len(failures) == 1
    assert "NameError" in failures[0] and "page.md:5" in failures[0]


def test_collector_honours_skip_marks(tmp_path: Path) -> None:
    p = _page(tmp_path, """\
        ```python
        ok = True
        ```

        <!-- docs-test: skip (needs a GPU) -->
        ```python
        raise SystemExit("should not run")
        ```

        - In a list:

            ```python
            assert ok
            ```
        """)
    blocks = extract_blocks(p)
    assert [b.mark for b in blocks] == [None, "skip", None]
    assert blocks[1].reason == "needs a GPU"
    assert run_page(p, tmp_path / "run", timeout=60) == []


def test_skip_marks_have_reasons() -> None:
    for path in PAGES:
        for b in extract_blocks(path):
            if b.mark == "skip":
                assert b.reason, f"{path.name}:{b.line}: a docs-test skip needs a reason"
