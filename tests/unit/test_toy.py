"""The kit's toy job (testing/toy.py) is the shipped tiny recipe: the demo and the CPU tests train what
``recipes/tiny_debug_mxfp8.yaml`` describes."""

from __future__ import annotations

from harness.mx_cases import TINY

from mbridge_mxfp8_plugin.adapters.recipes import load_recipe


def test_tiny_recipe_matches_the_cpu_demo_toy():
    from harness.bridge_loop import LoopSchedule

    from mbridge_mxfp8_plugin.testing.toy import ToyConfig

    bridge, options = load_recipe(TINY)
    toy, sched = ToyConfig(), LoopSchedule()
    ddp, opt = bridge["ddp"], bridge["optimizer"]
    assert (ddp["overlap_param_gather"], ddp["overlap_grad_reduce"]) == (
        toy.overlap_param_gather,
        toy.overlap_grad_reduce,
    )
    assert (ddp["grad_reduce_in_fp32"], ddp["align_param_gather"]) == (
        toy.grad_reduce_in_fp32,
        toy.align_param_gather,
    )
    assert ddp["bucket_size"] == toy.bucket_size and opt["lr"] == toy.lr
    assert (
        bridge["model"]["hidden_size"] == toy.dims[1]
        and bridge["train"]["micro_batch_size"] == toy.micro_batch_size
    )
    t = bridge["train"]
    assert (t["train_iters"], t["eval_interval"], t["eval_iters"]) == (
        sched.train_iters,
        sched.eval_interval,
        sched.eval_iters,
    )
    assert options.dp_size == 2  # the demo's world size
