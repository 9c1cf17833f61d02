"""Data: the webdataset shard format, image preprocessing, which samples each step holds, where
images decode, and the MindSpore training dataset.
"""
