"""Training: the train config, schedule, AdamW, loss, the compiled step, the loop, where batches
come from, checkpoints, and one run from files to files.
"""
