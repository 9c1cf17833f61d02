"""The search service: embeddings, text/image search, zero-shot ranking and a search page over the
champion model and its index, with dynamic batching and live model swaps (docs/serving.md).

Imports `clipms` and `registry`, never `stages/` or `flows/`.
"""
