"""Docstring examples that show their output run as written and print what they show (the others need a model,
files or a Hub repository, and are run by hand; see the tests of what they call)."""

import doctest
import importlib

import pytest


SELF_CONTAINED = [
    "hf_accel.compress.fisher",
    "hf_accel.kernels.cache",
    "hf_accel.kernels.hadamard",
    "hf_accel.kernels.quant",
    "hf_accel.training.data",
]


@pytest.mark.parametrize("module_name", SELF_CONTAINED)
def test_docstring_examples_print_what_they_show(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0
