"""The router's command line: the contract flags, derived defaults, and what the operator renders for it."""

from __future__ import annotations

from disagg_connector import contract

import pytest

from disagg_connector.router.config import RouterConfig, default_leg_timeout, parse_args
from disagg_operator.api.validation import parse
from disagg_operator.render import render

from tests.fixtures.models import EXAMPLES, load_example


def test_contract_flags():
    cfg = parse_args(
        [
            "--served-model-name", "qwen", "--mode", "pull", "--namespace", "ns", "--selector", "disagg.dev/model=qwen",
            "--port", "8000", "--leg-timeout-seconds", "20", "--kv-lease-seconds", "120", "--max-retries", "2",
            "--shutdown-grace-seconds", "15", "--disaggregation-threshold-tokens", "256",
        ]
    )  # fmt: skip
    assert (cfg.served_model_name, cfg.default_mode, cfg.namespace, cfg.selector) == ("qwen", "Pull", "ns", "disagg.dev/model=qwen")
    assert (cfg.port, cfg.leg_timeout, cfg.kv_lease_seconds, cfg.max_retries, cfg.shutdown_grace) == (8000, 20.0, 120.0, 2, 15.0)
    assert cfg.disaggregation_threshold_tokens == 256
    assert parse_args(["--served-model-name", "q", "--static-endpoints", "f.json"]).static_endpoints == "f.json"
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "q", "--namespace", "ns"])  # no selector, no static file


@pytest.mark.parametrize(("migration", "flag"), [({}, "2"), ({"maxMigrations": 5}, "5"), ({"enabled": False, "maxMigrations": 5}, "0")])
def test_migration_is_rendered_as_the_routers_budget(migration, flag):
    """spec.router.migration: on by default with 2 continuations; off renders 0, which the router reads as off."""
    doc = load_example(EXAMPLES[0])
    doc["spec"].setdefault("router", {})["migration"] = migration
    [deploy] = [o for o in render(parse(doc)).objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-migrations") + 1] == flag
    assert parse_args(args).max_migrations == int(flag)


def test_standalone_leg_timeout_is_derived_below_the_lease():
    """vLLM's default lease is 30 s; a standalone router's deadline must not equal it (issue 11)."""
    cfg = parse_args(["--served-model-name", "q", "--static-endpoints", "f.json"])
    assert cfg.kv_lease_seconds == 30.0 and cfg.leg_timeout == 20.0 < cfg.kv_lease_seconds
    assert RouterConfig("q").leg_timeout == default_leg_timeout(30.0) == 20.0
    assert parse_args(["--served-model-name", "q", "--static-endpoints", "f", "--kv-lease-seconds", "90"]).leg_timeout == 60.0


def test_a_deadline_at_or_past_the_lease_is_refused_with_what_to_change(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "q", "--static-endpoints", "f", "--leg-timeout-seconds", "30"])
    err = capsys.readouterr().err
    assert "must be below --kv-lease-seconds 30" in err and "kv_lease_duration" in err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_operators_rendered_arguments_parse(path):
    """The router's own parser judges what the operator renders for it, with the spec's lease and threshold."""
    model = parse(load_example(path))
    rendered = render(model)
    [deploy] = [o for o in rendered.objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")]
    cfg = parse_args(deploy["spec"]["template"]["spec"]["containers"][0]["args"])
    spec = model.spec
    assert cfg.kv_lease_seconds == spec.kv_transfer.lease_seconds > cfg.leg_timeout == spec.router.request_deadline_seconds
    assert cfg.disaggregation_threshold_tokens == spec.router.disaggregation_threshold_tokens
    assert cfg.max_migrations == (spec.router.migration.max_migrations if spec.router.migration.enabled else 0) > 0
    # No default mode is rendered: every engine pod carries its revision's mode, which the router follows.
    assert "--mode" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    engines = [o for o in rendered.objects if o["kind"] == "Deployment" and o["metadata"]["labels"].get(contract.LABEL_ROLE) in contract.ENGINE_ROLES]
    assert {e["spec"]["template"]["metadata"]["annotations"][contract.ANNOTATION_TRANSFER_MODE] for e in engines} == {rendered.plan.mode}
