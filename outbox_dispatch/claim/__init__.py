"""Claiming due rows and publishing them: claim passes, the publisher, queue lengths, the commit
listener.
"""
