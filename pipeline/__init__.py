"""What the pipeline's packages share (stages/, registry/, serving/, flows/): the typed loader of
params.yaml and the preflight check of a host and a training plan. The library (clipms/) never
imports it.
"""
