"""Every planted bug of tests/mutation_check.py still finds the code it plants into: a site edited away (or made
ambiguous) silently turns a bug into one the measure cannot plant, and the kill rate into a lie."""

from __future__ import annotations

from tests.mutation_check import MUTANTS, ROOT


def test_every_planted_bug_finds_its_site_exactly_once() -> None:
    broken = [f"{m.name}: found {(ROOT / m.path).read_text().count(m.before)} times in {m.path}"
              for m in MUTANTS if (ROOT / m.path).read_text().count(m.before) != 1]
    assert not broken, "\n".join(broken)


def test_every_planted_bug_names_tests_that_exist_and_a_change() -> None:
    assert len({m.name for m in MUTANTS}) == len(MUTANTS), "two planted bugs share a name"
    for m in MUTANTS:
        assert m.before != m.after, m.name
        for test in m.tests:
            assert (ROOT / test.split("::")[0]).exists(), f"{m.name}: {test} does not exist"
