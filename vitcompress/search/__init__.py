"""Search for the placement and keep ratios that follow the base best under a budget.

``space`` (candidates), ``cost`` (analytic MACs), ``strategy`` (which to score), ``score``
(calibration agreement), ``warmup`` (learned predictors), ``pareto``, ``cache`` and ``outputs``;
the workflow that joins them is ``vitcompress.search.driver``.
"""
