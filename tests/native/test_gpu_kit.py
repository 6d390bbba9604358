"""The GPU kit (native/gpu/) without a GPU: its selftest end to end against the
fake driver, NVML and torch (peers, PyTorch workloads, the NVML per-process
view, the Markdown table), and the report's rule that a peer's failed checks
are findings about the peer, never gpuslice's failures."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

GPU_DIR = Path(__file__).resolve().parents[2] / "native" / "gpu"
CUDA_INC = Path(os.environ.get("CUDA_INC", "/usr/local/cuda/include"))


def kitrun(module: str) -> ModuleType:
    """A module of the kit's runner (stdlib only, beside run_kit.py)."""
    if str(GPU_DIR) not in sys.path:
        sys.path.insert(0, str(GPU_DIR))
    return importlib.import_module(f"kitrun.{module}")


def test_selftest_end_to_end(tmp_path: Path) -> None:
    """`make -C native/gpu selftest`: the whole kit with a fake peer, the broken
    fake (every planted bug reported) and a broken peer (findings, our pass)."""
    if not (CUDA_INC / "cuda.h").is_file():
        pytest.skip(f"cuda.h not in {CUDA_INC} (the kit builds against the CUDA headers)")
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("make or cc missing")
    p = subprocess.run(
        ["make", "-C", str(GPU_DIR), "selftest", f"BUILD={tmp_path}", f"CUDA_INC={CUDA_INC}"],
        capture_output=True,
        text=True,
        timeout=600,  # about a minute and a half on an idle machine
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "selftest: ok" in out
    assert "selftest (planted bugs): ok" in out
    assert "selftest (broken peer): ok" in out
    md = (tmp_path / "selftest" / "report.md").read_text()
    assert "| none | gpuslice | fakepeer |" in md


def section(status: str, failing: str | None = None) -> dict:
    checks = [{"name": "accepted <= limit", "ok": failing is None, "required": True}]
    return {"status": status, "paths": {"cuMemAlloc_v2": {"status": status, "checks": checks}}}


def test_peer_failures_are_findings_not_ours() -> None:
    report = kitrun("report")
    rep = {"allocation": section("pass")}
    rep["allocation"]["peers"] = {"hami": section("fail", failing="x")}
    s = report.summarize(rep)
    assert s["status"] == "pass"
    assert s["failed_checks"] == []
    assert s["peer_findings"]["hami"] == ["allocation/paths/cuMemAlloc_v2: accepted <= limit"]
    # and the same failure as gpuslice's own is ours
    s = report.summarize({"allocation": section("fail", failing="x")})
    assert s["status"] == "fail"
    assert s["failed_checks"] == ["allocation/paths/cuMemAlloc_v2: accepted <= limit"]


@pytest.mark.parametrize(
    "text", ["none=/x.so", "gpuslice=/x.so", "Bad Name=/x.so", "hami", "hami=", "=/x.so"]
)
def test_peer_names_are_refused(text: str) -> None:
    common = kitrun("common")
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_named(text)


def test_peer_name_accepted() -> None:
    assert kitrun("common").parse_named("hami=/opt/hami/libvgpu.so") == (
        "hami",
        "/opt/hami/libvgpu.so",
    )


def test_markdown_has_a_column_per_library() -> None:
    md = kitrun("markdown").to_markdown(
        {
            "libraries": {"none": {}, "gpuslice": {"sha256": "ab" * 32}, "hami": {"note": "v2"}},
            "allocation": {
                "status": "pass",
                "limit": 4 << 30,
                "chunk": 300 << 20,
                "paths": {"cuMemAlloc_v2": {"accepted": 13, "status": "pass"}},
                "peers": {"hami": {"paths": {"cuMemAlloc_v2": {"accepted": 14, "status": "fail"}}}},
            },
            "summary": {"status": "pass", "peer_findings": {"hami": ["x"]}},
        }
    )
    assert "| | none | gpuslice | hami |".replace("| |", "|  |") in md
    assert "| `cuMemAlloc_v2`: allocations of 300 MiB accepted | — | 13 | 14 ✗ |" in md
    assert "hami: 1 failed checks or warnings" in md
    assert "n/a" not in md.split("## Memory")[1].split("##")[0]
