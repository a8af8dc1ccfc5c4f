"""Stage package for training (the built-in target, the EAGLE-3 head) and the pipeline
entry point `train/run.py`."""
