"""Vocabulary and pure decisions: errors, bounds, names, rows, families and their policies, the
settle decision, logs.
"""
