"""The control plane (`foreshock serve`): telemetry in over gRPC, risk scored live, directives out to
training jobs, metrics to Prometheus. docs/service.md describes it; docs/architecture.md has the picture.

A telemetry batch's path: servicers.py (gRPC, translation only) -> ingest.py (receipt on the event
loop; events and topology acted on at once) -> rounds.py (the one round scheduler, step closes with
steps.py; its drains run by a pipeline: worker.py, the scoring process with decode, value checks and the
predictor's online scorer behind scoring.py, or the same in this process) -> policy.py (alarms to
directives through jobs.py and store.py; node actions through actions.py), every decision logged by
decisions.py. server.py builds and owns them all (`build_server`, start/stop); command.py is the CLI.
"""
