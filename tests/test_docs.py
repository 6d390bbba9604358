"""What a reader of the README and docs/ follows leads somewhere: every link's
file exists in the repository and every anchor is a heading of its page (by
GitHub's rules); nothing depends on a file outside the repository; the
overlays the pages show change what they say they change."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_scheduler.sim import TRACE_SOURCE
from tests.deploy.kustomize import render

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    path.relative_to(ROOT)
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *ROOT.glob("native/**/*.md")]
)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (no code marks,
    links' text, no emphasis marks), lowercased, punctuation but ``-`` and
    ``_`` dropped, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor on ``path``, repeated ones numbered as GitHub does
    (``x``, ``x-1``, ``x-2``)."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), re.M):
        base = slug(heading)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Building your own image") == "building-your-own-image"
    assert slug("5. Sizing and failures") == "5-sizing-and-failures"
    assert (
        slug("`gpuslice sim`: replay, and the `--via` flag")
        == "gpuslice-sim-replay-and-the---via-flag"
    )
    assert slug("Why not [HAMi](https://x)? **Really**") == "why-not-hami-really"
    assert slug("snake_case & more") == "snake_case--more"


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_link_leads_to_a_file_and_heading_in_the_repository(page: Path) -> None:
    source = ROOT / page
    checked = 0
    for target in LINK.findall(prose(source.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.is_relative_to(ROOT), f"{page} links outside the repository: {target}"
        assert linked.exists(), f"{page} links to missing {target}"
        if anchor:
            assert linked.suffix == ".md", (
                f"{page}: an anchor into a file that is not a page: {target}"
            )
            assert anchor in anchors(linked), f"{page} links to {target}: no such heading"
        checked += 1
    if page.name != "README.md" or page.parent != Path("."):
        return
    assert checked > 10  # the README links its pages


def test_the_anchor_check_sees_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Scheduler extender\n\n## Same\n\n## Same\n\n```sh\n# not a heading\n```\n")
    assert anchors(page) == {"scheduler-extender", "same", "same-1"}
    assert "scheduler" not in anchors(page)
    assert "not-a-heading" not in anchors(page)


# What a reader runs names no file outside the repository (a clone has none).
OUTSIDE = re.compile(r"\.\./shared|shared/traces|/work/")
READ = [
    *PAGES,
    Path("Makefile"),
    *sorted(p.relative_to(ROOT) for p in (ROOT / "bench").glob("*.py")),
]


@pytest.mark.parametrize("path", READ, ids=str)
def test_nothing_a_reader_runs_needs_a_file_outside_the_repository(path: Path) -> None:
    for number, line in enumerate((ROOT / path).read_text().splitlines(), start=1):
        assert not OUTSIDE.search(line), f"{path}:{number} names a path outside the repository"


def test_make_help_names_no_path_outside_the_repository() -> None:
    result = subprocess.run(
        ["make", "-s", "help"], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert "make traces" in result.stdout
    assert "../" not in result.stdout


def test_the_readme_says_where_the_traces_come_from_and_how_to_get_them() -> None:
    readme = (ROOT / "README.md").read_text()
    flat = re.sub(r"\s+", " ", readme)
    assert TRACE_SOURCE in readme
    assert "cluster-trace-gpu-v2023/csv" in flat
    assert "make traces" in flat
    example = re.search(r"gpuslice sim --nodes (\S+)", readme)
    assert example is not None
    assert example.group(1).startswith("bench/traces/openb/")
    makefile = (ROOT / "Makefile").read_text()
    assert f"TRACE_SOURCE := {TRACE_SOURCE}\n" in makefile
    assert "TRACES ?= bench/traces/openb\n" in makefile
    assert "/bench/traces/" in (ROOT / ".gitignore").read_text().splitlines()


# ------------------------------------------------- the overlays the pages show


def overlays_shown(page: str) -> list[dict[str, Any]]:
    """Every kustomization of one's own that ``page`` shows with an ``images:``
    entry (an overlay beside ``k8s/``)."""
    found = []
    for block in re.findall(
        r"^```yaml\n(.*?)^```", (ROOT / "docs" / page).read_text(), re.S | re.M
    ):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and doc.get("kind") == "Kustomization" and doc.get("images"):
            found.append(doc)
    return found


def images(objects: list[dict[str, Any]]) -> set[str]:
    out = set()
    for obj in objects:
        spec = obj.get("spec", {})
        for template in (
            spec.get("template"),
            spec.get("jobTemplate", {}).get("spec", {}).get("template"),
        ):
            pod = (template or {}).get("spec", {})
            out.update(
                c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])
            )
    return out


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_images_entry_a_page_shows_changes_the_image(page: str, tmp_path: Path) -> None:
    shown = overlays_shown(page)
    if page == "install.md":
        assert len(shown) >= 3  # the registry, the kube-scheduler version, your own image
    base = images(render(ROOT / "k8s"))
    for number, kustomization in enumerate(shown):
        assert kustomization["resources"] == ["../k8s"]
        mine = tmp_path / str(number)
        (mine / "site").mkdir(parents=True)
        (mine / "k8s").symlink_to(ROOT / "k8s")
        (mine / "site" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        built = images(render(mine / "site"))
        for entry in kustomization["images"]:
            wanted = f"{entry.get('newName', entry['name'])}:{entry['newTag']}"
            assert wanted in built, f"{page}: images entry {entry} changes nothing: {sorted(built)}"
            assert wanted not in base
        assert len(built) == len(base)


def test_the_own_image_overlay_names_the_built_image(tmp_path: Path) -> None:
    """docs/install.md "Building your own image": every gpuslice container runs
    the image the overlay names, none the release's."""
    (own,) = [k for k in overlays_shown("install.md") if "0.1.0-site1" in str(k)]
    (tmp_path / "site").mkdir()
    (tmp_path / "k8s").symlink_to(ROOT / "k8s")
    (tmp_path / "site" / "kustomization.yaml").write_text(yaml.safe_dump(own))
    built = images(render(tmp_path / "site"))
    assert "registry.example.com/gpu/gpuslice:0.1.0-site1" in built
    assert not [i for i in built if i.startswith("ghcr.io/gpuslice/")]
    if shutil.which("kubectl"):  # where kubectl runs, kustomize itself agrees
        out = subprocess.run(
            ["kubectl", "kustomize", str(tmp_path / "site")],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        assert images([d for d in yaml.safe_load_all(out) if d]) == built
