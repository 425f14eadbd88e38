"""The registry of evaluation methods: what the command line offers is what is registered, and an
unknown name is refused cleanly."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from eogp_index.errors import ConfigError
from eogp_index.evaluation import methods as registry
from eogp_index.evaluation.cli import eval_group
from eogp_index.evaluation.fidelity import ModuleShape, plan_methods


def _cli_choices() -> list[str]:
    """The names ``eogp eval fidelity --methods`` lists in its help."""
    option = next(p for p in eval_group.commands["fidelity"].params if p.name == "methods")
    listed = re.search(r"from: ([a-z0-9,-]+)\.", option.help)
    assert listed, option.help
    return listed.group(1).split(",")


def test_every_method_the_cli_offers_is_registered_once():
    choices = _cli_choices()
    assert choices == list(registry.METHODS) and len(set(choices)) == len(choices)
    labels = [registry.label(name) for name in choices]
    assert len(set(labels)) == len(labels) and all(label != name for label, name in zip(labels, choices))
    families = registry.families()
    assert len({f.seed_index for f in families}) == len(families)
    assert {registry.family_of(name).family for name in choices} == {f.family for f in families}
    assert set(registry.DEFAULT_METHODS) < set(choices)
    # Every registered method plans dimensions at some budget (a family without them would be dead).
    modules = (ModuleShape("h.0.mlp.c_fc", 64, 17), ModuleShape("h.0.mlp.c_proj", 16, 65))
    configs, _ = plan_methods(modules, (64, 256, 1024), choices)
    assert {c.method for c in configs} == set(choices)
    assert all(c.spec is registry.family_of(c.method) and c.label == registry.label(c.method) for c in configs)


def test_a_family_cannot_take_a_registered_name():
    before = registry.families()
    with pytest.raises(ConfigError, match="'eogp'.*already registered"):
        class Copy(registry.MethodFamily, family="copy-of-eogp", seed_index=99):
            variants = (registry.Variant("eogp", "Copy", "1bit", order=99),)
    assert registry.families() == before and registry.label("eogp") == "EOGP"


def test_unknown_method_is_refused_with_the_choices_and_no_traceback(tmp_path):
    result = CliRunner().invoke(eval_group, ["fidelity", "--out", str(tmp_path), "--methods", "eogp,bogus"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "unknown method(s) 'bogus'" in message
    assert all(name in message for name in registry.METHODS)
    with pytest.raises(ConfigError, match="bogus"):
        registry.variant("bogus")
