"""The novelty alarm beside the model (predictor/novelty.py): scales from healthy rows, the fusion."""

from __future__ import annotations

import numpy as np
import pytest

from foreshock.predictor import features as ft
from foreshock.predictor import novelty


def _healthy(rows=novelty.MIN_HEALTHY_ROWS, seed=0):
    h = novelty.HealthySteadiness()
    rng = np.random.default_rng(seed)
    s = np.zeros((rows, len(ft.STEADY)))
    s[:, 0] = rng.random(rows) * 0.4                   # corrected ECC: chronic counting on healthy GPUs
    s[:, 1] = -rng.random(rows)                        # below its days: not steadier, counts as 0
    s[rng.random(rows) < 0.5, 2] = np.nan              # unknown: not counted
    h.add(s[: rows // 2])
    h.add(s[rows // 2:])                               # streamed in parts, as train.py adds node by node
    return h


def test_each_signal_is_scaled_by_its_own_healthy_extreme_with_a_floor():
    alarm = novelty.NoveltyAlarm().fit(_healthy())
    assert alarm.scales_[0] == pytest.approx(0.4, abs=2e-3)
    assert np.all(alarm.scales_[1:] == novelty.SCALE_FLOOR)
    X = np.zeros((3, ft.N_FEATURES), dtype=np.float32)
    X[1, ft.STEADY_COLS.start + 0] = 0.4              # corrected ECC at its healthy extreme
    X[2, ft.STEADY_COLS.start + 5] = 0.1              # NVLink recovery, never steady when healthy: 2x its floor
    np.testing.assert_allclose(alarm.level(X), [0.0, 1.0, 2.0], rtol=1e-2)


def test_the_fused_probability_is_the_models_until_a_signal_is_steadier_than_ever_when_healthy():
    alarm = novelty.NoveltyAlarm().fit(_healthy()).calibrate(0.01)
    levels = np.array([0.0, 0.99, 1.0, novelty.ALARM_LEVEL, 10.0])
    p_model = np.full(5, 1e-5)
    fused = alarm.fuse_level(p_model, levels)
    assert fused[0] == fused[1] == 1e-5
    assert 1e-5 < fused[2] < 0.01
    assert fused[3] == pytest.approx(0.01)            # the alarm level: the model's evacuation probability
    assert fused[4] == pytest.approx(0.01 * np.exp(novelty.SLOPE * novelty.CAP_LEVELS))   # capped
    assert np.all(np.diff(fused) >= 0)
    assert alarm.fuse_level(np.array([0.5]), np.array([2.0]))[0] == 0.5   # never lowers the model's


def test_too_few_healthy_rows_or_a_reference_out_of_range_is_refused():
    with pytest.raises(ValueError, match="healthy training rows"):
        novelty.NoveltyAlarm().fit(_healthy(rows=1000))
    alarm = novelty.NoveltyAlarm().fit(_healthy())
    for bad in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="reference probability"):
            alarm.calibrate(bad)


def test_the_manifest_section_round_trips():
    alarm = novelty.NoveltyAlarm().fit(_healthy()).calibrate(0.02)
    back = novelty.NoveltyAlarm.from_manifest(alarm.to_manifest(), "m/manifest.json")
    X = np.random.default_rng(4).random((50, ft.N_FEATURES)).astype(np.float32)
    np.testing.assert_array_equal(back.fuse(np.zeros(50), X), alarm.fuse(np.zeros(50), X))
