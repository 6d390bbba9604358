"""The case files themselves: each case named once, and a difference only where
gpuslice's outcome is not HAMi's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.hami.cases import KINDS, all_cases, load


def test_every_case_is_named_once() -> None:
    counts = Counter(case.source for case in all_cases())
    assert [source for source, n in counts.items() if n > 1] == []


def test_every_kind_has_cases() -> None:
    assert {case.kind for case in all_cases()} == set(KINDS)


def test_a_difference_gives_another_outcome_with_its_reason() -> None:
    for case in all_cases():
        if case.differs is None:
            assert "gpuslice" not in case.data, f"{case.source}: gpuslice outcome without differs"
            continue
        assert len(case.differs.split()) >= 5, f"{case.source}: say why it differs"
        assert case.data["gpuslice"] != case.data["expect"], f"{case.source}: no difference"


def test_a_key_given_twice_in_a_case_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(
        "hami_file: x_test.go\n"
        "cases:\n"
        "  - hami: T/one\n"
        "    kind: parse\n"
        "    note: first\n"
        "    note: second\n"
        "    pod: {containers: []}\n"
        "    expect: {none: true}\n"
    )
    with pytest.raises(yaml.constructor.ConstructorError, match="key given twice: note"):
        load(path)
