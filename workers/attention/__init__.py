"""What the model and the engine share about attention, below both (workers/attention/metadata.py)."""
