"""What every worker kind shares: registration, heartbeats, READY, the inbox and the step loop."""
