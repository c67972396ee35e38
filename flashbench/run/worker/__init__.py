"""The worker: the only code that imports solution code.

It runs in a sandbox (run/sandbox.py), maps the arena the judge allocated, and runs the batches
of calls it is sent. Everything it sends back is untrusted data: the judge reads the outputs
itself and keeps its own clock.
"""
