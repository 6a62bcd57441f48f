"""One view over the shapes a training config arrives in (config/view.py): megatron-core's dataclasses
as a ddp config alone, a tuple or keywords read the same, and what is not a config is refused."""

from __future__ import annotations

import pytest
from harness.mx_cases import DEFECTIVE, core_configs

from mbridge_mxfp8_plugin.config.validate import validate_config
from mbridge_mxfp8_plugin.errors import MXFP8UsageError


def test_tuple_and_keyword_forms_agree():
    kw = core_configs({"overlap_grad_reduce": False})
    a = validate_config(kw["ddp"], strict=False, installed=DEFECTIVE)  # ddp config alone
    b = validate_config((kw["ddp"], kw["optimizer"]), strict=False, installed=DEFECTIVE)
    c = validate_config(ddp=kw["ddp"], optimizer=kw["optimizer"], strict=False, installed=DEFECTIVE)
    for r in (a, b, c):
        assert [f.rule for f in r.errors] == ["MX006"]
    with pytest.raises(MXFP8UsageError):
        validate_config(kw["ddp"], optimizer=kw["optimizer"])
    with pytest.raises(MXFP8UsageError, match="DistributedDataParallelConfig"):
        validate_config((kw["optimizer"],))
    with pytest.raises(MXFP8UsageError):
        validate_config(object())
