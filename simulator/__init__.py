"""foreshock.simulator: a fault-injecting GPU cluster that writes schema-v1 telemetry and its incident log.

`foreshock simulate` (simulator/command.py) runs the batch simulator (batch.py); `LiveCluster` (live.py)
steps the same model (model.py) in real time for the collectors, the demo and the service tests. The
failure catalogue and incident process are in faults.py, the layout in topology.py; docs/simulator.md
describes the model of each failure mode and the sources of its figures.
"""
