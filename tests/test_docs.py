"""The README's and docs/'s relative links lead somewhere: every linked file exists, every #anchor is a
heading of the file it names (GitHub's heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no code blocks
    return {slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def test_slug_is_githubs():
    assert slug("The quickstart's rounds") == "the-quickstarts-rounds"
    assert slug("On a cluster (Ray)") == "on-a-cluster-ray"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no {linked})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {'; '.join(broken)}"


def test_extend_its_params_file_is_the_quickstarts_setting_with_a_title():
    import yaml

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    extend = readme[readme.index("## Extend it") :]
    spec = yaml.safe_load(re.search(r"```yaml\n(.*?)```", extend, flags=re.S)[1])
    quickstart = yaml.safe_load((REPO / "params" / "quickstart_digits.yaml").read_text(encoding="utf-8"))
    assert spec["base"] == quickstart["base"] and spec["title"]
    assert set(spec["grid"]["attack"]) <= set(quickstart["grid"]["attack"])


def test_the_readme_quickstart_table_is_the_committed_3_seed_table():
    """The table under "What the quickstart shows" is figures/quickstart_digits_3seeds.md's, row for row (a
    regenerated table moves the README's in the same commit)."""

    def table(text: str) -> list[str]:
        start = text.index("| Defense |")
        return [line for line in text[start:].splitlines() if line.startswith("|")][:9]

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = table(readme[readme.index("## What the quickstart shows") :])
    committed = table((REPO / "figures" / "quickstart_digits_3seeds.md").read_text(encoding="utf-8"))
    assert len(shown) == 9 and shown == committed


TIMES = re.compile(r"\b(\d[\d,]*(?:\.\d+)?) s\b")  # a time in seconds as the pages write it: "1244 s"


def stated_notebook_times() -> dict[str, str]:
    """{notebook: its first cell's text} of the notebooks whose "Scale and time" states a time."""
    import json

    cells = {}
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
        if "**Scale and time.**" in first:
            cells[path.name] = first
    return cells


def test_every_time_the_readme_and_notebooks_state_is_in_the_timing_table():
    # Issue 43 item 2: times measured, not remembered. Every "N s" of the README and of the notebooks'
    # "Scale and time" is a row of docs/timings.md (which says the CPU, torch, commit and load), and each
    # page links to it.
    table = (REPO / "docs" / "timings.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    pages = {"README.md": (REPO / "README.md").read_text(encoding="utf-8"), **stated_notebook_times()}
    assert len(pages) >= 3  # README, the quickstart's and your_own_defense's notebooks at least
    for name, text in pages.items():
        assert "docs/timings.md" in text, f"{name}: no link to docs/timings.md"
        for seconds in TIMES.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            assert any(re.search(rf"\b{re.escape(seconds)} s\b", row) for row in rows), (
                f"{name} states {seconds} s, which no row of docs/timings.md measures"
            )
    assert "AVX-512, 2 cores" in table and "AVX2, 2 cores" in table


def test_the_readme_stays_under_200_lines():
    # Issue 43 item 4: what it is, the two commands, the 3-seed table and claims, Extend it, where to read
    # on; the rest lives in docs/.
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move details to docs/"


def test_the_readmes_paper_scale_table_is_the_committed_gpu_reports_and_the_papers_numbers():
    """The README's "Results at the paper's scale" was typed by hand: each "ours" row must be its cells in
    the committed GPU reports (figures/gpu/), each "paper" row the paper's mean ± std at beta=0.9 in
    paper_results.csv (the package's copy; four NNM+Trimmed mean cells were once copied from beta=0)."""
    from prodigy_core.report import markdown_cells, pipe_tables
    from prodigy_core.results import paper_results

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Results at the paper's scale", 1)[1].split("\n## ", 1)[0]
    ((header, rows),) = [t for t in pipe_tables(section) if t[0][1] == "No attack"]
    number = re.compile(r"-?\d+\.\d+(?: ± \d+\.\d+)?")

    def first_number(cell: str) -> str | None:
        found = number.search(cell)
        return found[0] if found else None

    table = paper_results()
    table = table[(table["table"] == "femnist_n20") & (table["local_momentum"] == 0.9)]
    paper = {
        (r.defense, r.attack): f"{r.accuracy_mean:.2f} ± {r.accuracy_std:.2f}" for r in table.itertuples()
    }
    attacks = ["none", "alie", "foe_0.1", "foe_100", "lf", "sf"]
    reports = {"fp32": "table2_femnist_n20.md", "bf16": "table2_femnist_n20_bf16.md"}
    names = {"No defense": "none", "NNM+Trimmed mean": "nnm+trimmed_mean", "ProDiGy": "prodigy"}
    checked = 0
    for label, *cells in rows:
        defense = label.split(",")[0]  # "NNM+Trimmed mean, ours bf16", "ProDiGy, paper"
        for column, attack, cell in zip(header[1:], attacks, cells, strict=True):
            if "ours" in label:
                report = (REPO / "figures" / "gpu" / reports[label.split()[-1]]).read_text(encoding="utf-8")
                expected = first_number(markdown_cells(report).get((defense, column), "–"))
            else:
                expected = paper[names[defense], attack]
            assert first_number(cell) == expected, f"README {label} / {column}: {cell!r}, not {expected}"
            checked += 1
    assert checked == 8 * 6  # five "ours" rows, three "paper" rows


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_fence_is_a_line_of_its_own(page):
    """A fence with text after it (```` ``` More prose````) does not close its block: the rest of the page
    renders as code (docs/library.md did, once)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    fences = [line for line in lines if line.lstrip().startswith("```")]
    assert [line for line in fences if not re.fullmatch(r"\s*```\w*", line)] == []


def test_the_library_pages_python_runs_and_its_search_attack_is_scored_from_one_gram_matrix():
    """docs/library.md's code blocks run as written; its `Tilt` is a search attack whose line is trusted
    (checked against its rows) and scored from one Gram matrix, and it sends the candidate whose aggregate
    lands farthest from the honest mean: the argmax of the damages computed here by brute force (the
    pipeline run on each candidate's rows), which on these updates is t = 1.0, not the grid's last."""
    import torch

    from prodigy_core.aggregators import make_aggregator

    page = (REPO / "docs" / "library.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "docs/library.md", "exec"), scope)
    f, G = 3, torch.randn(10, 300, generator=torch.Generator().manual_seed(0))
    server = make_aggregator("prodigy", f)
    tilt = scope["Tilt"]()
    tilt.craft(G[f:], G[:f], server)
    assert tilt.last_gram is not None
    honest = G[f:]
    mean, sigma = honest.mean(0), honest.std(0, unbiased=False)  # ALIE's statistics: the population std

    def damage(t: float) -> float:  # |server(f rows of mu - t sigma, then the honest rows) - mu|
        sent = torch.cat([(mean - t * sigma).expand(f, -1), honest])
        return float(torch.linalg.vector_norm(server.peek(sent) - mean))

    grid = tilt.grid(10, f)
    damages = [damage(t) for t in grid]
    best = max(range(len(grid)), key=damages.__getitem__)
    assert best != len(grid) - 1 and sorted(damages)[-2] < 0.5 * damages[best]  # a clear argmax, not the last
    assert tilt.last_param == grid[best]
    assert [x for _, x in tilt.last_search] == pytest.approx(damages, rel=1e-4)
