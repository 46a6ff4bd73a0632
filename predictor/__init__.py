"""Foreshock's predictor: features from schema-v1 telemetry, training and evaluation, the model registry,
and the online scorer (docs/predictor.md).

Modules: signals (rows -> per-step base signals), features (windows, baselines, peers), labels,
groups (incident families and signatures, node types, what leave-one-out holds out), dataset (offline
streaming over a Parquet dataset), model (estimators and baselines), train, evaluate, leave_one_out,
report, registry (skops + manifest), fleetlevel (thresholds that follow the fleet's score level),
online (OnlineScorer), explain, command (`foreshock train`,
`foreshock evaluate`), synthetic (hand-built telemetry for tests), errors (ModelError).
"""
