"""`pagemesh simulate`: the mesh's own scheduling code in virtual time, on a cost model.

The scheduler core (services/scheduler/core.py: admission, placement, the handoff's books), each
worker's engine scheduler and block manager (workers/engine/scheduler.py, block_manager.py) run
unchanged; only the model forward is replaced by a step-time model (cost.py) and the network by
a transfer model. See docs/experiments/simulator.md.
"""
