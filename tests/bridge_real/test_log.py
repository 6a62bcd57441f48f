"""The plugin's problem reports reach the user under each framework's default logging.

Megatron-Bridge's ``setup_logging`` (run by ``pretrain()``; ``LoggerConfig.filter_warnings`` is
True by default) drops every record whose level is exactly WARNING from every logger that exists
then: the plugin used to report ``strict=False`` config problems at WARNING, and they never
printed. Each framework check runs in a fresh interpreter (``setup_logging`` changes the
process's loggers for good) with nothing configured but what the framework does itself.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.common import log as _log
from mbridge_mxfp8_plugin.common.log import WARNING_LEVEL, log_rank_zero

ROOT = Path(__file__).resolve().parents[2]

#: What every child prints through the plugin: the runtime adapter's strict=False report (the
#: call _adapter.check_job makes), a recipe applied with strict=False whose config breaks rule
#: MX006 (logged by recipes.apply_recipe), and the same text on the plugin's logger at plain
#: WARNING, the level the plugin used before (the control: it must vanish under Bridge).
_CHILD = textwrap.dedent(
    """
    import dataclasses, logging, sys, warnings
    from mbridge_mxfp8_plugin.common.log import log_rank_zero, logger
    from mbridge_mxfp8_plugin.adapters.recipes import apply_recipe
    from harness.te_stub import importer_scoped_stubs
    with importer_scoped_stubs():  # apply_recipe merges with Bridge's omegaconf_utils; its package reaches TE
        from megatron.bridge.training.utils import omegaconf_utils
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp, opt = DistributedDataParallelConfig(), OptimizerConfig(lr=1.0)

    @dataclasses.dataclass
    class Container:  # Bridge's shape, the sections this recipe touches
        ddp: object = dataclasses.field(default_factory=lambda: ddp)
        optimizer: object = dataclasses.field(default_factory=lambda: opt)

    def emit(phase):
        print(f"=== {phase}", file=sys.stderr, flush=True)
        logger.warning("OLD-LEVEL: MXFP8 config problems (strict=False)")
        log_rank_zero(logging.WARNING, "MXFP8 config problems (strict=False):\\n%s", "MX-TEST-WARNING")
        apply_recipe(Container(), sys.argv[1], ["ddp.overlap_grad_reduce=false", "mxfp8_plugin.strict=false"])

    # 1. plain Lightning (what a NeMo 2 / Lightning job has before the trainer logs anything)
    import lightning.pytorch  # configures its own logger only
    emit("lightning")
    # 2. then a default Bridge job's logging, as pretrain()'s setup installs it
    from harness.te_stub import importer_scoped_stubs
    with importer_scoped_stubs():  # megatron.bridge's package import reaches TE via peft
        from megatron.bridge.training.utils.log_utils import setup_logging
    setup_logging(filter_warning=True)  # LoggerConfig.filter_warnings's default
    emit("bridge")
    """
)

_RECIPE = """\
ddp:
  use_distributed_optimizer: true
  overlap_grad_reduce: true
  overlap_param_gather: true
  fp8_param_gather: true
  reuse_grad_buf_for_mxfp8_param_ag: true
optimizer:
  use_distributed_optimizer: true
  overlap_param_gather: true
  reuse_grad_buf_for_mxfp8_param_ag: true
mxfp8_plugin:
  dp_size: 2
"""


def _bridge_logger_default_filters_warnings() -> bool:
    """``LoggerConfig.filter_warnings``'s default, read from the installed Bridge's source (importing
    ``training/config.py`` costs a minute here)."""
    from harness.bridge_loop import find_bridge_file

    tree = ast.parse(find_bridge_file("training/config.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "LoggerConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", "") == "filter_warnings":
                    assert item.value is not None
                    return bool(ast.literal_eval(item.value))
    raise AssertionError("LoggerConfig.filter_warnings not found")


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, str]:
    """phase -> what the child printed on stderr in it."""
    for name in ("lightning", "megatron.bridge"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} not installed")
    recipe = tmp_path_factory.mktemp("logging") / "lenient.yaml"
    recipe.write_text(_RECIPE)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(recipe)],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",  # harness.te_stub
        timeout=600,
        env={**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, lightning, bridge = proc.stderr.split("=== ")
    return {"lightning": lightning, "bridge": bridge}


def _assert_problems_printed(err: str) -> None:
    assert "MX-TEST-WARNING" in err, err[-3000:]
    assert "MX006" in err and "overlap_grad_reduce" in err, err[-3000:]


def test_problems_print_under_bridge_default_logging(printed):
    assert _bridge_logger_default_filters_warnings() is True  # what a default Bridge job runs with
    _assert_problems_printed(printed["bridge"])
    # the control: the level the plugin used before is dropped by Bridge's filter
    assert "OLD-LEVEL" not in printed["bridge"]


def test_problems_print_under_lightning_default_logging(printed):
    _assert_problems_printed(printed["lightning"])
    assert "OLD-LEVEL" in printed["lightning"]  # no filter here: Lightning never hid them


def test_warnings_keep_their_name_and_threshold(caplog):
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        log_rank_zero(logging.WARNING, "w")
        log_rank_zero(logging.ERROR, "e")
    (warn, err) = caplog.records
    assert (warn.levelno, warn.levelname) == (WARNING_LEVEL, "WARNING")
    assert (err.levelno, err.levelname) == (logging.ERROR, "ERROR")
    # a user who silences below ERROR still silences plugin warnings
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="mbridge_mxfp8_plugin"):
        log_rank_zero(logging.WARNING, "hidden")
    assert caplog.records == []


def test_only_rank_zero_logs(caplog, monkeypatch):
    monkeypatch.setattr(_log, "_rank", lambda: 1)
    with caplog.at_level(logging.INFO, logger="mbridge_mxfp8_plugin"):
        log_rank_zero(logging.ERROR, "not from rank 1")
    assert caplog.records == []
