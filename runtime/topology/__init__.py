"""Topology (placeholder until the module lands)."""
