"""Foreshock's predictor: features from schema-v1 telemetry, training and evaluation, the model registry,
and the online scorer (docs/predictor.md).

Modules: signals (rows -> per-step base signals), features (windows, baselines, peers), labels,
dataset (offline streaming over a Parquet dataset), model (estimators and baselines), train, evaluate,
report, registry (skops + manifest), online (OnlineScorer), explain, command (`foreshock train`,
`foreshock evaluate`), synthetic (hand-built telemetry for tests).
"""
