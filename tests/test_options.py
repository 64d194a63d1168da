"""Settings: one typed options object, one table of every LADDER_* variable, read in one place."""

import re
from pathlib import Path

import pytest

from ladder.errors import LadderError
from ladder.options import NAMES, DecodeStep, RuntimeOptions, environment_value, variables_table

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "src" / "ladder"


def test_the_docs_table_is_the_codes():
    assert variables_table() in (ROOT / "docs" / "configuration.md").read_text()


def test_every_ladder_variable_the_package_names_is_in_the_table_and_read_only_through_it():
    named, readers, definers = set(), set(), set()
    for path in PACKAGE.rglob("*.py"):
        text, where = path.read_text(), path.relative_to(PACKAGE).as_posix()
        named |= set(re.findall(r"\bLADDER_[A-Z_]+\b", text))
        if re.search(r"environ(?:\.get)?\(?\[?[\"']LADDER_", text):
            readers.add(where)
        if re.search(r"=\s*[\"']LADDER_", text):  # a name given to a variable: a place that could read it
            definers.add(where)
    assert named <= NAMES, named - NAMES
    assert readers <= {"__init__.py"}, readers  # (it must act before anything is imported)
    assert definers == {"options.py"}, definers


def test_options_come_from_the_environment_once_and_bad_values_are_one_line_errors():
    environ = {"LADDER_DECODE_ATTENTION": "flex", "LADDER_CPU_GEMM_TEMPLATES": "0",
               "LADDER_INDUCTOR_OPTIONS": '{"coordinate_descent_tuning": true}'}
    options = RuntimeOptions.from_environment(DecodeStep.COMPILED_LAYERS, environ)
    assert options == RuntimeOptions(DecodeStep.COMPILED_LAYERS, "flex", False, {"coordinate_descent_tuning": True})
    assert RuntimeOptions.from_environment(environ={}) == RuntimeOptions()
    assert environment_value("LADDER_API_KEY", {"LADDER_API_KEY": ""}) is None
    with pytest.raises(KeyError):
        environment_value("LADDER_NOT_A_SETTING", {})
    with pytest.raises(LadderError, match="unknown decode attention 'paged'"):
        RuntimeOptions.from_environment(environ={"LADDER_DECODE_ATTENTION": "paged"})
    with pytest.raises(LadderError, match="LADDER_CPU_GEMM_TEMPLATES='yes': set 0 or 1"):
        RuntimeOptions.from_environment(environ={"LADDER_CPU_GEMM_TEMPLATES": "yes"})


@pytest.mark.parametrize("step, device, expected", [
    (DecodeStep.EAGER, "cpu", "sdpa"), (DecodeStep.COMPILED, "cpu", "products"),
    (DecodeStep.COMPILED_LAYERS, "cpu", "products"), (DecodeStep.COMPILED, "cuda", "sdpa")])
def test_the_default_decode_attention_depends_on_the_step_and_device(step, device, expected):
    assert RuntimeOptions(step).decode_attention_on(device) == expected
    assert RuntimeOptions(step, "sdpa").decode_attention_on(device) == "sdpa"  # given: the same everywhere
    # An eager step in half precision where ATen's kernel is slow in it (no AMX): two batched products
    slow_half = "matmul" if (step, device) == (DecodeStep.EAGER, "cpu") else expected
    assert RuntimeOptions(step).decode_attention_on(device, slow_half_attention=True) == slow_half
