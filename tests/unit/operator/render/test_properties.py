"""Property-based: every spec the models accept renders valid objects; every broken rule is refused
with a message that names the field."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_operator.api.validation import SpecError, parse

from tests.fixtures.strategies import BREAKERS, models
from tests.fixtures.render import check_invariants

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(models())
def test_valid_specs_are_accepted_and_render_valid_objects(obj: dict) -> None:
    check_invariants(obj)  # parses (raises SpecError otherwise), renders, validates every object


@SETTINGS
@given(models(), st.sampled_from(BREAKERS))
def test_broken_rule_is_refused_naming_the_field(obj: dict, breaker) -> None:
    _, mutations, path = breaker
    obj = copy.deepcopy(obj)
    for mutate in mutations:
        mutate(obj)
    try:
        parse(obj)
    except SpecError as error:
        assert path in [p.path for p in error.problems], error.problems
    else:
        raise AssertionError(f"{breaker[0]} was accepted")
