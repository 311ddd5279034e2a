"""Plug-in merges: by import path and by entry point, with parameters filtered by signature."""

import sys
import textwrap

import pytest

from fedunlearn.merging import MERGES, firm_merge
from strategies.merge_plugins import merge_kwargs, resolve_merge

PLUGIN = textwrap.dedent("""
    import torch
    from fedunlearn.merging import MergeResult

    def half_sum(updates, *, gamma=1.0):
        keys = list(updates[0].task_vector)
        delta = {k: 0.5 * gamma * sum(u.task_vector[k] for u in updates if u.role == "forget")
                 for k in keys}
        norm = float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())))
        return MergeResult(delta=delta, report={"method": "half-sum", "norm_final": norm})
""")


@pytest.fixture()
def plugin_path(tmp_path, monkeypatch):
    (tmp_path / "my_merges.py").write_text(PLUGIN)
    dist = tmp_path / "my_merges-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-merges\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fedunlearn.merges]\nhalf = my_merges:half_sum\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_merges", None)


def test_builtin_import_path_and_entry_point(plugin_path):
    assert resolve_merge("firm") is firm_merge
    by_path = resolve_merge("my_merges:half_sum")
    assert by_path.__name__ == "half_sum"
    assert resolve_merge("half") is by_path


def test_unknown_names_are_clear_errors(plugin_path):
    with pytest.raises(ValueError, match="unknown merge 'nope'.*firm.*plug-ins: half"):
        resolve_merge("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_merge("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        resolve_merge("my_merges:missing")


def test_merge_receives_only_the_parameters_it_names(plugin_path):
    params = {"gamma": 2.0, "alpha": 0.1, "epsilon": 1e-3, "k": 0.3}
    assert merge_kwargs(resolve_merge("half"), params) == {"gamma": 2.0}
    assert merge_kwargs(firm_merge, params) == {"gamma": 2.0, "alpha": 0.1, "epsilon": 1e-3}

    def takes_all(updates, **kwargs):
        return kwargs

    assert merge_kwargs(takes_all, params) == params


@pytest.mark.parametrize("name", sorted(MERGES))
def test_every_registered_merge_resolves_to_its_kernel(name):
    """merge=<name> picks the registered kernel (one Flower run per merge is not needed:
    test_end_to_end runs a few of them through the same registry)."""
    assert resolve_merge(name) is MERGES[name]
