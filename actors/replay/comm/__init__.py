"""Collectives: rebuilt process groups, async plan, replayer, size and bandwidth math."""
