"""Workflows: what each command does, built from loading, the graph, the method and measurement."""
