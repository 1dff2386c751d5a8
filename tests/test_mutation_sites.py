"""Every planted bug of tests/mutation_check.py still finds the code it plants into: a site edited away (or made
ambiguous) silently turns a bug into one the measure cannot plant, and the kill rate into a lie."""

from __future__ import annotations

import platform

import pytest

from infer.kernels.native import c_compiler
from tests.mutation_check import HOST_KINDS, HOST_TAG, MUTANTS, ROOT, builds_of, c_sites_compiled


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


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the host kinds are x86's")
@pytest.mark.skipif(c_compiler() is None, reason="no C compiler")
def test_every_planted_bug_in_c_is_compiled_on_some_host_and_names_the_hosts_it_needs() -> None:
    # A site only AVX512 or AMX builds compile is never compiled on an AVX2 host, so no test can catch it there
    # (mutation_check lists it as not run); the name says so. A site no build compiles plants nothing anywhere.
    compiled = {kind: c_sites_compiled(MUTANTS, builds_of(*HOST_KINDS[kind])) for kind in HOST_KINDS}
    wrong = []
    for m in (m for m in MUTANTS if m.path.endswith(".c")):
        needs = next((kind for kind in HOST_KINDS if m.name in compiled[kind]), None)
        tag = HOST_TAG.search(m.name)
        named = tag.group(1) if tag else "AVX2"
        if needs is None:
            wrong.append(f"{m.name}: its site is compiled by no host's build (dead code, or inside a comment)")
        elif named != needs:
            wrong.append(f"{m.name}: first compiled on {needs} hosts, named for {named}"
                         + (f" (add '({needs} hosts)' to its name)" if needs != "AVX2" else " (drop the tag)"))
    assert not wrong, "\n".join(wrong)
