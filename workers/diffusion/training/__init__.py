"""Training the embedded image model: the digits data and the DiT training script."""
