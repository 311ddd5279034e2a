"""dp2u_study's options and table writer (the Flower cells are covered by test_dp2u_flower)."""

import argparse

import pytest

from simulations.dp2u_study import _lr_map, _lr_override, study_markdown


def test_dp_lr_by_epsilon_applies_to_dp_sgd_cells_only():
    lrs = _lr_map("1:0.05,10:0.2")
    assert lrs == {1.0: 0.05, 10.0: 0.2}
    assert _lr_override("dp2u-sgd", 10.0, lrs) == (" dp2u.dp-lr=0.2", "-lr0.2")
    assert _lr_override("dp2u-sgd", 25.0, lrs) == ("", "")  # not listed: the run config's
    assert _lr_override("dp2u-mlm", 10.0, lrs) == ("", "")  # DP-MLM has no DP-SGD stage
    for bad in ("1=0.05", "1:0.05:3", "1:-0.1", "0:0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _lr_map(bad)


def test_markdown_has_one_row_per_cell_and_marks_failed_data_checks():
    row = {"model_utility": 0.5, "forget_quality": 2e-5, "trained_on_retained_only": False}
    summary = {
        "table": [{"forget_percent": 5.0, "method": "ga", **row}],
        "sweep": [{"method": "dp2u-sgd", "epsilon": 10.0, **row, "dp_lr": 0.2}],
    }
    lines = study_markdown(summary).splitlines()
    assert lines[2].startswith("| 5 | ga | 0.500 | – | 2.00e-05 |")
    assert lines[2].endswith("| NO |")
    assert lines[-1].startswith("| dp2u-sgd | 10 | 0.500 |") and "| 0.200 |" in lines[-1]
