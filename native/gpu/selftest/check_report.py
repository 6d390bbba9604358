#!/usr/bin/env python3
"""Checks the report of `make selftest` (the kit run against the fake driver):
every section must reach the verdict the perfect fake deserves, so a broken
kit (argument, JSON or check bug) shows here without a GPU."""

import json
import sys

EXPECTED = {
    "environment": {"pass"},
    "allocation": {"pass"},
    "lookup": {"pass"},
    "nvml": {"pass"},
    "pytorch": {"pass"},  # selftest/fake_torch stands in for PyTorch
    "compute": {"pass"},
    "overhead": {"info"},
}


def check_broken(rep: dict) -> list:
    """The run with GS_FAKE_BREAK=managed-unlimited,array-leak,sm-skew: exactly
    the planted bugs must be reported."""
    problems = []
    paths = (rep.get("allocation") or {}).get("paths", {})
    want_fail = {"cuMemAllocManaged", "cuArrayCreate_v2", "cuArray3DCreate_v2"}
    for p, e in paths.items():
        st = e.get("status")
        if (p in want_fail) != (st == "fail"):
            what = "missed" if p in want_fail else "not planted"
            problems.append(f"broken: allocation {p}: status {st}, bug {what}")
    failed = {
        c["name"] for c in paths.get("cuMemAllocManaged", {}).get("checks", []) if not c["ok"]
    }
    for name in ("refused with CUDA_ERROR_OUT_OF_MEMORY", "accepted <= limit"):
        if name not in failed:
            problems.append(f"broken: cuMemAllocManaged: check {name!r} did not fail")
    checks = paths.get("cuArrayCreate_v2", {}).get("checks", [])
    failed = {c["name"] for c in checks if not c["ok"]}
    if "freeing everything restores free == limit" not in failed:
        problems.append("broken: cuArrayCreate_v2: the leak was not caught")
    comp = rep.get("compute") or {}
    single = {x["target_pct"]: x for x in comp.get("single", [])}
    # sm-skew spaces kernels 25 % too far apart: 90 % becomes about 72 %
    if comp.get("status") != "fail" or not single or not 66 < single[90]["achieved_pct"] < 80:
        got = single.get(90)
        problems.append(f"broken: compute: status {comp.get('status')}, 90% -> {got} (want ~72)")
    if rep.get("summary", {}).get("status") != "fail":
        problems.append("broken: summary does not say fail")
    return problems


def main() -> int:
    path = sys.argv[-1]
    with open(path) as f:
        rep = json.load(f)
    if "--broken" in sys.argv:
        problems = check_broken(rep)
        for p in problems:
            print("selftest: " + p, file=sys.stderr)
        print(
            f"selftest (planted bugs): {'FAILED' if problems else 'ok, every planted bug reported'}"
        )
        return 1 if problems else 0
    problems = []
    for name, ok in EXPECTED.items():
        st = (rep.get(name) or {}).get("status")
        if st not in ok:
            problems.append(f"{name}: status {st!r}, expected one of {sorted(ok)}")
    paths = (rep.get("allocation") or {}).get("paths", {})
    if len(paths) != 9:
        problems.append(f"allocation: {len(paths)} paths, expected 9")
    for p, e in paths.items():
        n = e.get("accepted")
        if n != 13:  # 4 GiB / 300 MiB
            problems.append(f"allocation {p}: accepted {n}, expected 13")
    single = (rep.get("compute") or {}).get("single") or []
    if len(single) != 5:
        problems.append(f"compute: {len(single)} single-process limits, expected 5")
    pair = (rep.get("compute") or {}).get("pair") or {}
    if pair.get("ratio") is None:
        problems.append("compute: no pair ratio")
    if rep.get("summary", {}).get("status") != "pass":
        problems.append(f"summary: {rep.get('summary', {}).get('failed_checks')}")
    warn = rep.get("summary", {}).get("warnings", [])
    for p in problems:
        print("selftest: " + p, file=sys.stderr)
    print(
        f"selftest: {'FAILED' if problems else 'ok'} ({len(warn)} warnings: the fake has no "
        "nvidia-smi and is itself the 'interposer', so its unhooked lookups and NVML pointers warn)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
