"""The CLIP model: architecture configs and presets as data, the MindSpore Cells, and the
conversion of open_clip weights both ways.
"""
