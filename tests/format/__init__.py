"""What is written: format versions, steps, the catalog, the save pipeline, export."""
