"""tfm_common.show: library source shown in chapters, and error bounds printed there."""

import pytest

import tfm_numpy as tnp
from tfm_common.show import about, bound, print_errors, show_source


def test_show_source_is_the_library_code():
    md = show_source(tnp.Linear, methods=("forward", "backward"))
    assert md.data.startswith("```python\n# tfm_numpy.layers.Linear")
    assert "def backward(self, grad_out" in md.data and "def __init__" not in md.data


@pytest.mark.parametrize(
    ("x", "text"), [(0.0, "0 exactly"), (3.2e-10, "< 1e-09"), (0.5, "< 1e+00"), (1e-16 * 1.5, "< 1e-15")]
)
def test_bound(x, text):
    assert bound(x) == text


def test_bound_rejects_nan_and_negative():
    with pytest.raises(ValueError, match="non-negative"):
        bound(float("nan"))
    with pytest.raises(ValueError, match="non-negative"):
        bound(-1.0)


def test_bound_states_its_claim():
    assert bound(3e-16, below=1e-12) == "< 1e-15"
    assert bound(0.2, above=1e-3) == "< 1e+00"
    with pytest.raises(AssertionError, match="expected an error below 1e-12, got 3.000e-09"):
        bound(3e-9, below=1e-12)
    with pytest.raises(AssertionError, match="expected an error above 1e-03, got 1.000e-06"):
        bound(1e-6, above=1e-3)


def test_about_marks_a_machine_dependent_result():
    assert about(0.99351) == "~0.9935"
    assert about(13, "d") == "~13"


def test_print_errors_reports_failures(capsys):
    assert print_errors({"a": 1e-9}, 1e-7)
    assert not print_errors({"a": 1e-9, "b": 1e-3}, 1e-7)
    assert "False" in capsys.readouterr().out
