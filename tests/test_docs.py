"""Every code block of README.md and docs/*.md runs or parses as written, offline.

- ```python blocks run in order, one namespace per page (a later block may use what an earlier one
  made, as a reader would), in a temporary working directory that has an empty ``docs/img/`` (blocks
  that write a figure where the docs keep it write it there) and a copy of ``docs/study_results/``
  (the saved study results the docs read); a block that raises fails its page's test, and the
  traceback names the page and its line.
- A block that needs the Hugging Face Hub, timm's pretrained weights or a dataset that is not embedded
  is marked with ``<!-- docs-test: offline -->`` on the line before its fence: it runs with the local
  stand-ins of :mod:`tests.docs_stand_ins` (random weights for pretrained ones, tiny models for Hub
  models, tiny folders for datasets) and must use at least one of them. Every block runs with the Hub
  in offline mode: an unmarked block that reaches for it fails at once.
- ``<!-- docs-test: slow -->`` (or ``offline slow``): a block too long for the fast tier runs only in
  the slow tier, where the page runs whole (a later block that needs its results is slow too).
- ``<!-- docs-test: skip REASON -->`` skips one block (the rare block that cannot run here); the
  reason is required.
- Every fence names its language: ```python, ```bash, ```text, ```json ... (a bare fence is an error:
  a Python fragment is either a program or says it is text). In ```bash blocks every ``vitattn ...``
  command (also ``python -m vitattn`` and ``torchrun ... -m vitattn``) is parsed by the real argument
  parser (:func:`vitattn.cli.build_parser`), not run; shell variables set in the block are expanded.
- ``pip install`` extras named anywhere in the pages exist in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from .docs_stand_ins import offline_stand_ins

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = ("offline", "slow")  # a marker holds flags, or "skip" and a reason

# Pages whose blocks other branches were rewriting when this harness was written: their Python blocks
# are not run and their fences not checked here until the lead merges those branches and removes the
# page from this set (then `python -m pytest tests/test_docs.py` must pass with it on). An empty set is
# the goal; every name must be a page.
PENDING_PAGES: frozenset[str] = frozenset()

OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<text>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    flags: tuple[str, ...]  # of its marker: ("offline",), ("offline", "slow"), ("skip",) ...
    why: str  # a skipped block's reason

    @property
    def skip(self) -> bool:
        return "skip" in self.flags

    @property
    def offline(self) -> bool:
        return "offline" in self.flags

    @property
    def slow(self) -> bool:
        return "slow" in self.flags

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


@dataclass(frozen=True)
class Parsed:
    blocks: list[Block]
    problems: list[str]  # unclosed fences, markers not followed by a fence


@contextlib.contextmanager
def _nothing() -> Iterator[list[str]]:
    yield []


def parse(page: Path) -> Parsed:
    """The fenced blocks of a Markdown page (CommonMark fences: ``` or ~~~, indented or not)."""
    lines = page.read_text().splitlines()
    rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if m is None or (m["fence"][0] == "`" and "`" in m["info"]):
            if MARKER.match(lines[i]) and not (i + 1 < len(lines) and OPEN.match(lines[i + 1])):
                problems.append(f"{rel}:{i + 1}: a docs-test marker must be the line right before a fence")
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{rel}:{i + 1}: a fence that is never closed")
            break
        body = "\n".join(
            line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1 : end]
        )
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        words = marker["text"].split() if marker else []
        flags, why = (("skip",), " ".join(words[1:])) if words[:1] == ["skip"] else (tuple(words), "")
        info = m["info"].strip()
        blocks.append(Block(page, i + 1, info.split()[0] if info else "", body + "\n", flags, why))
        i = end + 1
    return Parsed(blocks, problems)


def blocks(page: Path) -> list[Block]:
    return parse(page).blocks


def checked(page: Path) -> bool:
    return page.name not in PENDING_PAGES


def test_pending_pages_are_pages() -> None:
    assert PENDING_PAGES <= {p.name for p in PAGES}, (
        f"not pages: {sorted(PENDING_PAGES - {p.name for p in PAGES})}"
    )
    assert [p for p in PAGES if checked(p)], "no page is checked"


def test_every_fence_names_its_language() -> None:
    bare = [b.where for page in PAGES if checked(page) for b in blocks(page) if not b.lang]
    assert not bare, f"code fences without a language (```python / ```text / ```bash ...): {bare}"


def test_fences_and_markers_are_well_formed() -> None:
    found = [b for page in PAGES if checked(page) for b in blocks(page)]
    assert found
    problems = [p for page in PAGES if checked(page) for p in parse(page).problems]
    problems += [
        f"{b.where}: unknown docs-test flags {b.flags} (any of {FLAGS}, or skip REASON)"
        for b in found
        if not b.skip and (set(b.flags) - set(FLAGS) or len(set(b.flags)) < len(b.flags))
    ]
    problems += [f"{b.where}: a skipped block must say why" for b in found if b.skip and not b.why]
    problems += [
        f"{b.where}: only a python block can be offline or slow"
        for b in found
        if (b.offline or b.slow) and b.lang != "python"
    ]
    assert not problems, "\n".join(problems)


def run_page(
    page: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch, slow: bool = True
) -> list[tuple[Block, float, float]]:
    """Runs the page's Python blocks in order in one module namespace (those marked slow only if
    ``slow``); the wall and CPU seconds of each."""
    import huggingface_hub.constants

    (workdir / "docs" / "img").mkdir(parents=True)
    shutil.copytree(ROOT / "docs" / "study_results", workdir / "docs" / "study_results")
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    times = []
    for block in blocks(page):
        if block.lang != "python" or block.skip or (block.slow and not slow):
            continue
        # the block's lines keep their line numbers in the page: tracebacks point into the Markdown
        stand_ins = offline_stand_ins(workdir / ".stand-ins") if block.offline else _nothing()
        start, cpu = time.perf_counter(), time.process_time()
        with stand_ins as used:
            try:
                code = compile("\n" * block.line + block.body, str(block.page), "exec")
                exec(code, module.__dict__)  # noqa: S102 - the docs' own code
            except Exception as exc:
                raise AssertionError(
                    f"the block at {block.where} raised {type(exc).__name__}: {exc}"
                ) from exc
        if block.offline:
            assert used, f"the block at {block.where} is marked offline but used no stand-in: drop the marker"
        times.append((block, time.perf_counter() - start, time.process_time() - cpu))
    return times


# optional dependencies (extras) a page may import: its blocks run only where they are installed
OPTIONAL = {"transformers": "transformers", "vitattn.hf": "transformers"}


def optional_imports(page: Path) -> list[str]:
    """The optional modules that the page's Python blocks import (``import transformers``, ``from
    vitattn.hf import ...``), to skip the page cleanly where they are missing."""
    found = {
        OPTIONAL[name]
        for b in blocks(page)
        if b.lang == "python" and not b.skip
        for m in re.finditer(r"^\s*(?:import|from)\s+([\w.]+)", b.body, re.M)
        for name in OPTIONAL
        if m[1] == name or m[1].startswith(f"{name}.")
    }
    return sorted(found)


def test_optional_imports(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport torch\n  from transformers.models import vit\n```\n"
        "<!-- docs-test: skip not here -->\n```python\nimport vitattn.hf\n```\n"
    )
    assert optional_imports(page) == ["transformers"]
    page.write_text("```python\nimport vitattn\n```\n```text\nimport transformers\n```\n")
    assert optional_imports(page) == []
    assert optional_imports(ROOT / "docs" / "huggingface.md") == ["transformers"]


PY_PAGES = [p for p in PAGES if any(b.lang == "python" for b in blocks(p))]
# pages with blocks marked slow run twice: without them in the fast tier, whole in the slow tier
RUNS = [
    *(pytest.param(p, False, id=p.name) for p in PY_PAGES),
    *(
        pytest.param(p, True, id=f"{p.name}-slow", marks=pytest.mark.slow)
        for p in PY_PAGES
        if any(b.slow for b in blocks(p))
    ),
]


@pytest.mark.usefixtures("one_thread")  # on a shared 2-core machine a third of the time of two threads
@pytest.mark.parametrize("page,slow", RUNS)
def test_python_blocks_run(page: Path, slow: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not checked(page):
        pytest.skip(
            f"{page.name} is pending (PENDING_PAGES): its blocks are being rewritten on another branch"
        )
    for module in optional_imports(page):
        pytest.importorskip(module, reason=f"{page.name} imports {module}, which is not installed")
    for block, wall, cpu in run_page(page, tmp_path, monkeypatch, slow=slow):  # shown with pytest -rP
        print(f"{block.where}: {wall:.2f} s, {cpu:.2f} s CPU")


def _expand(word: str, variables: dict[str, str]) -> list[str]:
    """A word with ``$NAME`` / ``${NAME}`` expanded: the block's own assignments split into words when
    the word is just the variable (unquoted, as a shell does), other variables kept as their name."""
    whole = re.fullmatch(r"\$(\w+)|\$\{(\w+)\}", word)
    if whole and (whole[1] or whole[2]) in variables:
        return shlex.split(variables[whole[1] or whole[2]])
    return [re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: variables.get(m[1] or m[2], m[1] or m[2]), word)]


def vitattn_commands(body: str) -> list[list[str]]:
    """The arguments of every ``vitattn`` command in a bash block: the words after ``vitattn`` in a
    command that is not an ``echo`` or an ``install`` (``vitattn``, ``time vitattn``, ``python -m
    vitattn``, ...)."""
    variables: dict[str, str] = {}
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            line_words = [*lexer, ";"]
        except ValueError as err:  # unbalanced quotes
            raise ValueError(f"{line!r}: {err}") from err
        command: list[str] = []
        for word in line_words:
            if not (word and set(word) <= set(";&|")):
                command.append(word)
                continue
            assignment = re.fullmatch(r"(\w+)=(.*)", command[0], re.S) if len(command) == 1 else None
            if assignment:
                variables[assignment[1]] = assignment[2]
            while command and re.fullmatch(r"\w+=.*", command[0], re.S):  # FOO=bar vitattn ...
                command.pop(0)
            # vitattn ..., time vitattn ..., python -m vitattn ..., torchrun ... -m vitattn ...
            at = [i for i, w in enumerate(command) if w == "vitattn" or w.endswith("/vitattn")]
            if at and command[0] not in ("echo", "printf") and "install" not in command[: at[0]]:
                start = at[0] + 1
                out.append([w for word in command[start:] for w in _expand(word, variables)])
            command = []
    return out


def _commands(block: Block) -> list[list[str] | str]:
    """:func:`vitattn_commands` of a block, or the shell error as one string."""
    try:
        return list(vitattn_commands(block.body))
    except ValueError as err:
        return [str(err)]


BASH = [
    (b, words)
    for p in PAGES
    if checked(p)
    for b in blocks(p)
    if b.lang in ("bash", "sh", "shell", "console") and not b.skip
    for words in _commands(b)
]


def test_vitattn_commands_are_found() -> None:
    body = (
        "M=\"--model-arg depth=2 --model-arg 'img_size=32'\"   # two arguments\n"
        'pip install -e . && vitattn analyze vit_tiny $M --out "$OUT/a"  # a comment\n'
        "vitattnx info; python -m vitattn info | cat; pip install vitattn\n"
        "torchrun --nproc_per_node 2 -m vitattn study \\\n    --seeds 3\n"
        "FOO=1 vitattn bench --quick || echo vitattn study\n"
        "for i in 1 2; do /usr/bin/time -f '%e s' vitattn study --out runs/main-$i; done\n"
    )
    assert vitattn_commands(body) == [
        ["analyze", "vit_tiny", "--model-arg", "depth=2", "--model-arg", "img_size=32", "--out", "OUT/a"],
        ["info"],
        ["study", "--seeds", "3"],
        ["bench", "--quick"],
        ["study", "--out", "runs/main-i"],
    ]


def test_bash_blocks_have_vitattn_commands() -> None:
    assert len(BASH) >= 5, "the parse tests below found almost no vitattn command: is the parser broken?"


@pytest.mark.parametrize(
    "block,words", BASH, ids=[f"{b.page.name}:{b.line}:{i}" for i, (b, _) in enumerate(BASH)]
)
def test_vitattn_commands_parse(block: Block, words: list[str] | str) -> None:
    from vitattn.cli import build_parser

    assert isinstance(words, list), f"{block.where}: not a shell command: {words}"
    try:
        build_parser().parse_args(words)
    except SystemExit as exc:
        if exc.code not in (0, None):  # 0: --help
            raise AssertionError(
                f"{block.where}: `vitattn {shlex.join(words)}` does not parse (exit {exc.code})"
            ) from exc


def test_pip_extras_exist() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {
        (page.name, extra.strip())
        for page in PAGES
        for m in re.finditer(r"pip install[^`\n]*?(?:vitattn|\.)\[([\w, -]+)\]", page.read_text())
        for extra in m[1].split(",")
    }
    assert any(page == "README.md" for page, _ in named)
    missing = sorted(f"{page}: [{extra}]" for page, extra in named if extra not in extras)
    assert not missing, f"extras not in pyproject.toml: {missing}"


@pytest.mark.usefixtures("one_thread")
def test_offline_stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins the offline blocks may need, each once (the checked pages use only some of them),
    and nothing of them left afterwards."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    import huggingface_hub.constants
    import timm
    import transformers

    import vitattn.hf
    from vitattn.datasets import ADE20KSegmentation

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with offline_stand_ins(tmp_path / ".stand-ins") as used:
        model = transformers.AutoModel.from_pretrained("facebook/dinov2-small")
        assert type(model) is transformers.Dinov2Model and model.config.hidden_size == 32
        assert (
            transformers.AutoConfig.from_pretrained("openai/clip-vit-base-patch32").model_type
            == "clip_vision_model"
        )
        assert (
            transformers.AutoImageProcessor.from_pretrained("google/vit-base-patch16-224").size["height"]
            == 32
        )
        loaded = vitattn.hf.load_model("hf:path/to/dinov2")
        assert type(loaded.model).__name__ == "Dinov2Model"
        vit = timm.create_model("hf-hub:sinahmr/locatvit_tiny", pretrained=True, img_size=32, patch_size=8)
        assert type(vit).__name__ == "LocAtViT"
        ade = ADE20KSegmentation("data", "val", image_size=16)
        image, mask = ade[0]
        assert image.shape == (3, 16, 16) and int(mask[mask != 255].max()) < 150
    assert len(set(used)) == 7, "\n".join(used)  # some are used twice: AutoModel reads the config too
    with pytest.raises(OSError):
        transformers.AutoConfig.from_pretrained("facebook/dinov2-small")
    with pytest.raises(Exception, match="ADE20K not found"):
        ADE20KSegmentation(tmp_path / "elsewhere", "val")


def test_run_page_follows_the_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself on a page of its own: order, one namespace, the markers, the line numbers."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nran = ['plain']\n```\n"
        "<!-- docs-test: slow -->\n```python\nran.append('slow')\n```\n"
        "<!-- docs-test: skip it cannot run here -->\n```python\nraise RuntimeError\n```\n"
        "<!-- docs-test: offline -->\n```python\nfrom vitattn.datasets import VOCSegmentation\n"
        "VOCSegmentation('data', 'train', image_size=8)\nran.append('offline')\n```\n"
        "```text\nnot python\n```\n"
    )
    assert [(b.line, b.lang, b.flags, b.why) for b in blocks(page)] == [
        (1, "python", (), ""),
        (5, "python", ("slow",), ""),
        (9, "python", ("skip",), "it cannot run here"),
        (13, "python", ("offline",), ""),
        (18, "text", (), ""),
    ]
    for slow, ran in ((False, ["plain", "offline"]), (True, ["plain", "slow", "offline"])):
        with monkeypatch.context() as mp:
            times = run_page(page, tmp_path / f"run-{slow}", mp, slow=slow)
            assert sys.modules[f"docs_{page.stem}"].ran == ran
        assert [b.line for b, _, _ in times] == ([1, 5, 13] if slow else [1, 13])
    page.write_text("text\n\n```python\nx = 1\n\nundefined_name\n```\n")
    with pytest.raises(AssertionError, match="page.md:3 raised NameError") as err:
        run_page(page, tmp_path / "error", monkeypatch)
    assert err.value.__cause__.__traceback__.tb_next.tb_lineno == 6  # the page's line
