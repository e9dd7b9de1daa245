"""mkdocs hook: files that live outside docs/ join the site (README.md as the home page, the benchmark
results of bench/results/), and links are written between the repository's files, so the same link
works on GitHub and in the site: each is mapped to where its target lands in the site.

`docs/benchmarks.md` holds RESULTS where the list of every results page goes.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "<!-- bench-results -->"
LINK = re.compile(r"(\]\()([^)#\s:]+)")  # the target of an inline link or image, up to an anchor


def site_path(repo_path: str) -> str | None:
    """Where a repository file lands in the site, None when it is not part of it."""
    if repo_path == "README.md":
        return "index.md"
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    if repo_path.startswith("bench/results/"):
        return repo_path
    return None


def results() -> list[Path]:
    return sorted(p for p in (ROOT / "bench" / "results").iterdir() if p.suffix in (".md", ".png"))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    for path in results():
        uri = f"bench/results/{path.name}"
        files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page: Page, **kwargs: Any) -> str:
    here = Path(page.file.abs_src_path).relative_to(ROOT).as_posix()

    def relink(match: re.Match) -> str:
        target = site_path(posixpath.normpath(posixpath.join(posixpath.dirname(here), match.group(2))))
        if target is None:
            return match.group(0)  # mkdocs reports it: the site has no such page
        return match.group(1) + posixpath.relpath(target, posixpath.dirname(page.file.src_uri) or ".")

    return LINK.sub(relink, markdown.replace(RESULTS, results_list(posixpath.dirname(here))))


def results_list(page_dir: str) -> str:
    """Every results page, named by its first heading where it has one; linked from page_dir."""
    items = []
    for path in results():
        if path.suffix == ".md":
            link = posixpath.relpath(f"bench/results/{path.name}", page_dir or ".")
            title = next((line[2:] for line in path.read_text().splitlines() if line.startswith("# ")), "")
            items.append(f"- [{path.name}]({link})" + (f": {title}" if title else ""))
    return "\n".join(items)
