"""Spawns and supervises the rank processes of local replicas (see supervisor.supervisor)."""
