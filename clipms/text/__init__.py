"""Text: the CLIP-style byte-level BPE tokenizer and the deterministic BPE trainer.
"""
