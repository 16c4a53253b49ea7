"""Tools that work on a run directory: launch a run (train + evaluate + record), re-evaluate, reproduce, probe."""
