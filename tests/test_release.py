"""Releasing: `make image`/`make push`, the release and CI workflows, and the
check that a release tag names the version pyproject and k8s/ carry."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _load_release_version() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "release_version", ROOT / ".ci" / "release_version.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release_version = _load_release_version()


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def kustomization_image() -> str:
    """The registry and repository k8s/ installs the gpuslice image from."""
    ((name, _tag),) = release_version.k8s_images(ROOT)
    return str(name)


def workflow(name: str) -> dict[Any, Any]:
    doc: dict[Any, Any] = yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())
    return doc


def triggers(doc: dict[Any, Any]) -> dict[str, Any]:
    # YAML 1.1 reads the key `on` as true
    on: dict[str, Any] = doc["on"] if "on" in doc else doc[True]
    return on


def steps(doc: dict[Any, Any]) -> list[dict[str, Any]]:
    return [step for job in doc["jobs"].values() for step in job["steps"]]


def action(doc: dict[Any, Any], name: str) -> dict[str, Any]:
    found = [s for s in steps(doc) if str(s.get("uses", "")).split("@")[0] == name]
    assert len(found) == 1, f"{name} used {len(found)} times"
    return found[0]


# make image / make push


def test_make_image_builds_the_kustomization_image_at_pyprojects_version() -> None:
    result = make("-n", "image")
    assert result.returncode == 0, result.stderr
    assert f"docker build -t {kustomization_image()}:{VERSION} ." in result.stdout.splitlines()


def test_make_image_takes_image_and_version_from_the_command_line() -> None:
    result = make("-n", "image", "IMAGE=registry.example.com/team/gpuslice", "VERSION=0.9.1-rc1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "docker build -t registry.example.com/team/gpuslice:0.9.1-rc1 ." in lines
    assert not any(VERSION in line and "docker build" in line for line in lines)


def test_make_image_ignores_image_and_version_in_the_environment() -> None:
    # a shell's VERSION or IMAGE meant for something else never tags the image
    result = make("-n", "image", env={"VERSION": "9.9.9", "IMAGE": "elsewhere/x"})
    assert result.returncode == 0, result.stderr
    assert f"docker build -t {kustomization_image()}:{VERSION} ." in result.stdout.splitlines()


def test_make_push_builds_then_pushes_the_same_tag() -> None:
    result = make("-n", "push", "IMAGE=registry.example.com/gpuslice")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    build = lines.index(f"docker build -t registry.example.com/gpuslice:{VERSION} .")
    push = lines.index(f"docker push registry.example.com/gpuslice:{VERSION}")
    assert build < push


def test_make_image_without_docker_says_so() -> None:
    result = make("image", "DOCKER=gpuslice-no-such-docker")
    assert result.returncode != 0
    assert "'gpuslice-no-such-docker' not found: install Docker" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_image_with_no_daemon_says_so() -> None:
    # `false info` fails as `docker info` does when no daemon answers
    result = make("image", f"DOCKER={shutil.which('false')}")
    assert result.returncode != 0
    assert "the Docker daemon is not running or not reachable" in result.stderr


@pytest.mark.parametrize("version", ["1.0 ; touch /tmp/x", "", "-rc", "a" * 129])
def test_make_image_refuses_a_version_that_is_no_tag(version: str) -> None:
    result = make("image", f"VERSION={version}", f"DOCKER={shutil.which('false')}")
    assert result.returncode != 0
    assert "is not an image tag" in result.stderr or "no version" in result.stderr
    assert "daemon" not in result.stderr


def test_make_help_lists_image_and_push() -> None:
    out = make("help").stdout
    assert re.search(r"^make image\b", out, re.M)
    assert re.search(r"^make push\b", out, re.M)


# the release workflow


def test_release_runs_on_version_tags_only() -> None:
    on = triggers(workflow("release.yml"))
    assert set(on) == {"push"}
    assert on["push"] == {"tags": ["v*"]}


def test_release_builds_both_platforms_and_pushes_with_provenance_and_sbom() -> None:
    doc = workflow("release.yml")
    build = action(doc, "docker/build-push-action")["with"]
    assert set(build["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert build["push"] is True
    assert build["provenance"]
    assert build["sbom"] is True
    assert build["tags"] == "${{ steps.meta.outputs.tags }}"
    # arm64 on an amd64 runner needs QEMU and buildx
    action(doc, "docker/setup-qemu-action")
    action(doc, "docker/setup-buildx-action")


def test_release_pushes_to_the_registry_k8s_installs_from() -> None:
    doc = workflow("release.yml")
    image = kustomization_image()
    assert doc["env"]["IMAGE"] == image
    assert action(doc, "docker/metadata-action")["with"]["images"] == "${{ env.IMAGE }}"
    login = action(doc, "docker/login-action")["with"]
    assert login["registry"] == image.split("/")[0]
    assert login["password"] == "${{ secrets.GITHUB_TOKEN }}"
    assert doc["permissions"] == {"contents": "read", "packages": "write"}


def test_release_tags_version_minor_and_commit() -> None:
    tags = action(workflow("release.yml"), "docker/metadata-action")["with"]["tags"].split()
    assert "type=semver,pattern={{version}}" in tags
    assert "type=semver,pattern={{major}}.{{minor}}" in tags
    assert any(t.startswith("type=sha") for t in tags)


def test_release_pushes_only_what_passed_the_tests() -> None:
    jobs = workflow("release.yml")["jobs"]
    assert jobs["image"]["needs"] == "test"
    assert any(s.get("run") == ".ci/run" for s in jobs["test"]["steps"])
    assert jobs["test"]["permissions"] == {"contents": "read"}


def test_release_checks_the_tag_before_anything_is_pushed() -> None:
    doc = workflow("release.yml")
    names = [str(s.get("uses") or s.get("run")) for s in steps(doc)]
    check = next(i for i, n in enumerate(names) if ".ci/release_version.py" in n)
    assert '"$GITHUB_REF_NAME"' in names[check]
    build = next(i for i, n in enumerate(names) if n.startswith("docker/build-push-action"))
    login = next(i for i, n in enumerate(names) if n.startswith("docker/login-action"))
    assert check < login < build


def test_actions_are_pinned_to_a_major_version() -> None:
    for name in ("release.yml", "ci.yml"):
        for step in steps(workflow(name)):
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), step["uses"]


def test_ci_runs_the_test_command_on_push_and_pull_request() -> None:
    doc = workflow("ci.yml")
    assert {"push", "pull_request"} <= set(triggers(doc))
    assert any(s.get("run") == ".ci/run" for s in steps(doc))
    assert "make test" in (ROOT / ".ci" / "run").read_text()


# the version check


def run_check(tag: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "release_version.py"), tag],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_current_version_tag_passes_the_check() -> None:
    result = run_check(f"v{VERSION}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == VERSION


@pytest.mark.parametrize("tag", ["v99.0.0", VERSION, f"v{VERSION}x", f"release-{VERSION}", ""])
def test_a_tag_that_is_not_the_version_fails_the_check(tag: str) -> None:
    result = run_check(tag)
    assert result.returncode == 1
    assert result.stderr.startswith("error: tag ")
    assert "Traceback" not in result.stderr


IMAGES = "images:\n  - name: gpuslice\n    newName: ghcr.io/gpuslice/gpuslice\n    newTag: '{}'\n"


@pytest.mark.parametrize("where", ["k8s", "k8s/images"])
def test_the_check_fails_when_k8s_installs_another_version(tmp_path: Path, where: str) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "1.2.3"\n')
    (tmp_path / where).mkdir(parents=True, exist_ok=True)
    images = tmp_path / where / "kustomization.yaml"
    if where != "k8s":
        # the image set in a component k8s/ includes
        (tmp_path / "k8s" / "kustomization.yaml").write_text("components: [images, ../outside]\n")
    images.write_text(IMAGES.format("1.2.2"))
    with pytest.raises(ValueError, match=r"installs the gpuslice image at \['1.2.2'\], not 1.2.3"):
        release_version.check("v1.2.3", tmp_path)
    images.write_text(IMAGES.format("1.2.3"))
    assert release_version.check("v1.2.3", tmp_path) == "1.2.3"


def test_the_check_fails_when_k8s_names_no_gpuslice_image(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "1.2.3"\n')
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "kustomization.yaml").write_text("resources: [namespace.yaml]\n")
    with pytest.raises(ValueError, match="installs the gpuslice image at no tag"):
        release_version.check("v1.2.3", tmp_path)


def test_k8s_installs_the_version_being_built() -> None:
    assert [tag for _, tag in release_version.k8s_images(ROOT)] == [VERSION]
