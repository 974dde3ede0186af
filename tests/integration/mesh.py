"""The real mesh for integration tests: see services/local_mesh.py."""

from services.local_mesh import free_port, metrics, per_worker, running_mesh, wait_until  # noqa: F401
