"""Reports of an `Estimate`: text tables (text.py) and plots (plot.py, PNG or HTML)."""
