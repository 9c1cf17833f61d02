"""Deployment: MindIR export and its parity check, inference on an exported bundle, the search
index and its search, and the checks on a served model's untrusted inputs.
"""
