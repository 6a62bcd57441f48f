"""``mxfp8-plugin demo`` end to end: one rank launch of the reference, plugin-off and plugin-on runs."""

from __future__ import annotations


def test_demo_matches_reference_with_plugin_and_fails_without(monkeypatch):
    """``mxfp8-plugin demo`` on a short schedule (one rank launch): exit code 0 with the plugin,
    and its verdict on a plugin that did nothing (the OFF run reported as ON) is exit code 1."""
    import io

    from mbridge_mxfp8_plugin.commands import demo

    runs = demo.collect_runs(world_size=2, train_iters=5, eval_interval=2)
    assert sorted(runs["reference"].eval_losses) == [2, 4] and len(runs["on"].train_losses) == 5
    monkeypatch.setattr(demo, "collect_runs", lambda **_: runs)
    buf = io.StringIO()
    assert demo.run_demo(train_iters=5, eval_interval=2, out=buf) == 0, buf.getvalue()
    assert "RESULT: plugin run matches the reference" in buf.getvalue()
    assert "WRONG" in buf.getvalue()  # plugin OFF is off the reference at an eval or the step after

    buf = io.StringIO()
    assert demo.report({**runs, "on": runs["off"]}, buf) == 1, buf.getvalue()
    assert "RESULT: plugin run does NOT match the reference" in buf.getvalue()
