"""Data-parallel training: the `msrun` launcher, the script each worker runs, and the collectives
the workers use. No module both launches and is launched.
"""
