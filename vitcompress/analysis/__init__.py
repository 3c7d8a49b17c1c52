"""Analysis: capture a model as a torch.fx graph and find its blocks, attention, prefix tokens,
token grid, grid ops and position tables (the model map). Knows no method."""
