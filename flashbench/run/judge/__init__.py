"""The judge's own steps: inputs and their seeds, reference outputs, the comparison, the clock.

Nothing here imports solution code; everything a verdict depends on is computed here.
"""
