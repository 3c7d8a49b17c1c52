"""Artifacts: a compressed model saved with its source and plan, and rebuilt exactly or refused."""
