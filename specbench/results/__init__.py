"""What a run writes and shows: columns, schema, records and summaries, the run directory, serving
rows, the context sweep, tables, figures and comparisons."""
