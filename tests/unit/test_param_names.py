"""The weight check's reports name params as ``named_parameters`` does, prefixed with their
chunk's index where there are several (``weights._param_names``): the names a user looks up."""

from __future__ import annotations

import pytest
import torch

from mbridge_mxfp8_plugin.verify.weights import _param_names


class _Shared(torch.nn.Module):
    """A module reached twice, a param registered under two names, an unset param."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
        self.c = self.a
        self.register_parameter("unset", None)
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.b[0].weight = self.w


def _torch_names(chunks: list[torch.nn.Module]) -> dict[int, str]:
    prefix = len(chunks) > 1
    named = [(c, n, p) for c, ch in enumerate(chunks) for n, p in ch.named_parameters()]
    return {id(p): (f"{c}." if prefix else "") + n for c, n, p in named}


@pytest.mark.parametrize(
    "make",
    [
        lambda: [_Shared()],
        lambda: [_Shared(), _Shared()],
        lambda: [
            torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2), 2, enable_nested_tensor=False)
        ],
    ],
    ids=["shared", "two-chunks", "torch-transformer"],
)
def test_names_are_named_parameters(make) -> None:
    chunks = make()
    assert _param_names(chunks) == _torch_names(chunks)


def test_a_param_in_two_chunks_has_the_later_chunks_name() -> None:
    first, second = _Shared(), _Shared()
    second.a.weight = first.a.weight
    names = _param_names([first, second])
    assert names[id(first.a.weight)] == "1.a.weight" == _torch_names([first, second])[id(first.a.weight)]
