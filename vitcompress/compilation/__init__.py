"""Compilation: the plan (a method at locations, keeping how much) made from a model map by
asking the method, the rewrite that inserts its reducers, and ``compress()`` tying them together."""
