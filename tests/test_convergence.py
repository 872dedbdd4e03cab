"""Training quality: compressed training on real data keeps up with fp32."""
from __future__ import annotations

import pytest

pytest.importorskip("sklearn")

from gradzip.tools.demo import run_demo  # noqa: E402


@pytest.mark.timeout(300)
def test_maxmin_4bit_with_error_feedback_matches_fp32_on_digits():
    report = run_demo(["fp32", "maxmin4"], out=None, workers=2, epochs=8)
    acc = {r["config"]: r["test_accuracy"] for r in report["results"]}
    assert acc["fp32"] >= 95.0, acc  # the baseline itself learned the task
    assert acc["maxmin4"] >= acc["fp32"] - 1.0, acc  # within one point of fp32
    assert all(r["identical"] for r in report["results"])
    ratio = {r["config"]: r["ratio"] for r in report["results"]}
    assert ratio["maxmin4"] > 4, ratio  # and it did compress
