"""Data preparation: synthetic MSCOCO look-alike, caption metadata, dedupe, img2dataset, shards.

Pure Python/pandas/img2dataset code; nothing here imports MindSpore.
"""
