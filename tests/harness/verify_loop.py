"""The loop steps and instruments of the verifier's rank cases (harness.verify_cases).

Megatron-LM's loop order on the toy job: :func:`train` runs the kit's
:func:`~mbridge_mxfp8_plugin.testing.megatron_lm_loop.train_step` (the first step without forward
pre-hooks), :func:`forward_backward` the same order cut before ``optimizer.step()`` (where the
weights must equal the quantized main params the optimizer has not yet stepped), :func:`forced_sync`
the forced all-gather of eval / save / train end. Beside them: an all-gather counter, an in-memory
checkpoint (``param.data`` as the save's forced sync leaves it, and the fp32 main shards) and the
plugin's ERROR records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ITERS",
    "ErrorLines",
    "counting_gathers",
    "forced_sync",
    "forward_backward",
    "load_snapshot",
    "one_batch",
    "snapshot_of",
    "train",
]

ITERS = 3  # training steps before each probe: the weights have moved well past MXFP8's grid


@contextlib.contextmanager
def counting_gathers(counter: list[int]) -> Iterator[None]:
    """Count the param all-gathers megatron-core issues (it binds its gather function at import)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    real = pgb.dist_all_gather_func

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return real(*args, **kwargs)

    pgb.dist_all_gather_func = counted
    try:
        yield
    finally:
        pgb.dist_all_gather_func = real


def one_batch(job: Any, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mbridge_mxfp8_plugin.testing.toy import make_batches

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ((x, y),) = make_batches(job.toy, 1, rank=rank, world=world, salt=salt)
    return x, y


def train(job: Any, iters: int, sync: Any = None) -> None:
    """Megatron-LM's ``train()`` steps: the first without forward pre-hooks, then with them."""
    from mbridge_mxfp8_plugin.testing.megatron_lm_loop import train_step

    for chunk in job.model:
        chunk.disable_forward_pre_hook(param_sync=False)
    for it in range(iters):
        if sync is not None:
            sync.step_started()
        train_step(job, *one_batch(job, it))
        if it == 0:
            for chunk in job.model:
                chunk.enable_forward_pre_hook()


def forward_backward(job: Any, salt: int) -> None:
    """``train_step`` up to, not including, ``optimizer.step()``: the params must now be the
    quantized main params (gathered and copied back by the forward pre-hooks)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    for opt in getattr(job.optimizer, "chained_optimizers", [job.optimizer]):
        if isinstance(opt, DistributedOptimizer):
            opt._copy_main_params_to_param_buffer()  # Megatron-LM stages while pre-hooks are on
    loss = job.model[0](*one_batch(job, salt))
    loss.backward()
    for chunk in job.model:
        chunk.finish_grad_sync()


def forced_sync(job: Any) -> None:
    for chunk in job.model:
        chunk.disable_forward_pre_hook()  # the forced all-gather of eval / save / train end


def snapshot_of(job: Any) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """What a checkpoint holds after a save: every ``param.data`` and the fp32 main shards."""
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    weights = {
        f"{i}.{n}": (p.dequantize() if hasattr(p, "dequantize") else p.detach()).clone()
        for i, chunk in enumerate(job.model)
        for n, p in chunk.named_parameters()
    }
    mains = [
        [m.detach().clone() for g in opt.optimizer.param_groups for m in g["params"]]
        for opt in distributed_optimizers(job.optimizer)
    ]
    return weights, mains


def load_snapshot(job: Any, snapshot: tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]) -> None:
    from mbridge_mxfp8_plugin.mcore.layout import distributed_optimizers

    weights, mains = snapshot
    with torch.no_grad():
        for i, chunk in enumerate(job.model):
            for n, p in chunk.named_parameters():
                p.data.copy_(weights[f"{i}.{n}"].to(p.dtype))  # an MXFP8 param quantizes
        for opt, saved in zip(distributed_optimizers(job.optimizer), mains, strict=True):
            params = [m for g in opt.optimizer.param_groups for m in g["params"]]
            for m, value in zip(params, saved, strict=True):
                m.copy_(value)


class ErrorLines:
    """The plugin's ERROR records (rank zero logs them; the others see none)."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler(level=logging.ERROR)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]

    def __enter__(self) -> list[str]:
        import logging

        logging.getLogger("mbridge_mxfp8_plugin").addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: Any) -> None:
        import logging

        logging.getLogger("mbridge_mxfp8_plugin").removeHandler(self.handler)
