"""Every built-in merge hands its Δ over weight by weight (``delta_out``): the same values as
the dict it returns without one, and no weight's Δ kept alive once the next one is merged."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, MutableMapping

import pytest
import torch

from fedunlearn.merging import MERGES, ClientUpdate

SHAPES = {"a": (8, 6), "b": (5, 7), "c": (4, 4), "d": (9,)}


def _updates() -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(3)
    roles = [("forget", "x"), ("forget", "x"), ("forget", "y"), ("retain", None), ("retain", None)]
    return [
        ClientUpdate(
            node_id=i,
            role=role,
            domain=domain,
            num_examples=4,
            task_vector={k: torch.randn(s, generator=g) for k, s in SHAPES.items()},
            fisher={k: torch.rand(s, generator=g) ** 2 for k, s in SHAPES.items()},
        )
        for i, (role, domain) in enumerate(roles)
    ]


class AliveProbe(MutableMapping[str, torch.Tensor]):
    """Keeps a copy of each Δ it receives, and checks at every hand-over that the merge let go
    of the Δ it handed over before (only a weak reference to it is kept)."""

    def __init__(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self.most_alive = 0
        self._refs: list[weakref.ref] = []

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        gc.collect()
        self.most_alive = max(self.most_alive, sum(ref() is not None for ref in self._refs))
        self.copies[key] = value.clone()
        self._refs.append(weakref.ref(value))

    def __getitem__(self, key: str) -> torch.Tensor:
        raise AssertionError(f"the merge read Δ {key!r} back")

    def __delitem__(self, key: str) -> None:
        raise AssertionError("the merge deleted a Δ")

    def __iter__(self) -> Iterator[str]:
        return iter(self.copies)

    def __len__(self) -> int:
        return len(self.copies)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("firm", {"epsilon": 0.5}),
        ("firm", {}),
        ("fulm", {}),
        ("fulm-mean", {}),
        ("ties", {}),
        ("avg", {}),
        ("sum", {}),
    ],
)
def test_delta_out_gets_every_weight_once_and_equal_to_the_returned_dict(name, params):
    merge = MERGES[name]
    whole = merge(_updates(), **params)
    probe = AliveProbe()
    streamed = merge(_updates(), **params, delta_out=probe)
    assert streamed.delta is probe
    assert list(probe.copies) == list(whole.delta) == list(SHAPES)
    for key in SHAPES:
        assert torch.equal(probe.copies[key], whole.delta[key]), key
    assert streamed.report == whole.report
    assert probe.most_alive == 0  # the previous weight's Δ was freed before the next came
