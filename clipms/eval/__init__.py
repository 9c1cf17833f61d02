"""Evaluation: retrieval and zero-shot metrics (numpy), embedding a split, labelled zero-shot
sets, and the files an evaluation writes.
"""
