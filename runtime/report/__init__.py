"""Showing results: the cost report's formats and plot (format, plot) and the attention alignment
of a run (alignment, alignment_plot). The alignment lives here, not under io/, because it is a
view of a run's outputs drawn as a plot, like the report's, and shares its plotting helpers."""
