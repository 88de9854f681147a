"""The fuzzer in the suite: Hypothesis sends tenant B's hostile calls (`tests/serve/hostile.py`) to a real server
with two tenants while tenant A's greedy request runs alongside. No call may get a 5xx, /health stays up, and
A's text never changes. A bounded run (about a minute); `benchmarks/fuzz.py` is the long one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.serve.hostile import Call, Fuzzer, calls


@pytest.fixture(scope="module")
def fuzzer(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzer]:
    with Fuzzer(tiny_llama, tmp_path_factory.mktemp("fuzz")).running() as running:
        yield running
    tally = running.tally
    assert not tally.reference_mismatches, tally.reference_mismatches[:3]
    assert tally.reference_runs > 0


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(call=calls)
def test_no_hostile_call_gets_a_5xx_or_takes_health_down(fuzzer: Fuzzer, call: Call) -> None:
    status = fuzzer.send(call)
    assert status < 500, fuzzer.tally.server_errors[-1]
    assert fuzzer.healthy()


def test_the_other_tenants_greedy_text_never_changed(fuzzer: Fuzzer) -> None:
    tally = fuzzer.tally
    assert tally.sent >= 400 and tally.reference_runs > 0
    assert not tally.reference_mismatches, tally.reference_mismatches[:3]
    assert tally.health_failures == 0
