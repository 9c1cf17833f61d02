"""What every room of the library shares: atomic file writes, JSON files, URLs made safe to
print, and the digest of the code a module runs.
"""
