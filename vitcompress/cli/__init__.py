"""The command line: thin click commands that parse, call a workflow and render with rich."""
